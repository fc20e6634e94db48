"""Schedule and microbatch search scored by the timeline simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.errors import PipetrainError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.search import search, simulate_plan
from pipetrain.plan.topology import Topology

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


def chain(forward):
    return Profile([LayerProfile(f"l{i}", forward_s=f, backward_s=2 * f)
                    for i, f in enumerate(forward)])


def straight_plan(forward, schedule="pipedream", microbatches=1):
    profile = chain(forward)
    topology = Topology.flat(len(forward), float("inf"))
    plan = optimize(profile, topology, straight=True, schedule=schedule,
                    microbatches=microbatches)
    return plan, profile, topology


def test_pipedream_steady_state_is_the_slowest_stage():
    # docs/design.md 3.2: S = 4, F = 1, B = 2 -> 3 per minibatch in steady state
    plan, profile, topology = straight_plan([1.0] * 4)
    assert simulate_plan(plan, profile, topology).time_per_minibatch == pytest.approx(3.0)
    # unbalanced F = (1, 1, 2, 1): bottleneck 6
    plan, profile, topology = straight_plan([1.0, 1.0, 2.0, 1.0])
    assert simulate_plan(plan, profile, topology).time_per_minibatch == pytest.approx(6.0)


def test_flush_schedule_pays_the_bubble():
    # docs/design.md 3.1: 1f1b, S = 4, m = 8: makespan 33 in microbatch units of F/m = 1/8
    plan, profile, topology = straight_plan([1.0] * 4, schedule="1f1b", microbatches=8)
    sim = simulate_plan(plan, profile, topology)
    assert sim.time_per_minibatch == pytest.approx(33 / 8)
    assert sim.bubble_fraction == pytest.approx(1 - 3 / (33 / 8))
    # straight 1f1b: stage s holds min(S - s, m) microbatches of activations
    assert sim.microbatches == 8


def test_search_respects_memory_and_scores_by_simulation():
    profile = parse_graph_txt((PROFILES / "vgg16.txt").read_text())
    topology = Topology.flat(4)
    free = search(profile, topology, schedules=["pipedream", "1f1b"], microbatches=[4, 8])
    limit = 0.5 * max(s.memory_bytes for s in free.stages)
    plan = search(profile, topology, memory_limit=limit, schedules=["pipedream", "1f1b"],
                  microbatches=[4, 8])
    assert max(s.memory_bytes for s in plan.stages) <= limit
    fitting = [c for c in plan.extra["schedule_candidates"] if c.get("fits")]
    assert plan.extra["simulated_time_per_minibatch"] == \
        min(c["simulated_time_per_minibatch"] for c in fitting)
    assert all(c["peak_memory_bytes"] <= limit for c in fitting)
    with pytest.raises(PipetrainError, match="smallest memory limit that fits is"):
        search(profile, topology, memory_limit=1e6, schedules=["pipedream", "1f1b"],
               microbatches=[4])
