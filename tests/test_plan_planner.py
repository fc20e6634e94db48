"""The planner front door: schedule choice and baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.errors import PipetrainError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.stage_memory import SCHEDULES
from pipetrain.plan.planner import compare_baselines, make_plan
from pipetrain.plan.profile import Profile
from pipetrain.plan.topology import Topology

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


@pytest.fixture(scope="module")
def vgg():
    return parse_graph_txt((PROFILES / "vgg16.txt").read_text())


def test_auto_picks_the_fastest_simulated_candidate(vgg):
    plan = make_plan(vgg, Topology.flat(4), schedule="auto")
    scored = [c for c in plan.extra["schedule_candidates"] if "error" not in c]
    assert {c["schedule"] for c in plan.extra["schedule_candidates"]} == set(SCHEDULES)
    assert {"pipedream", "2bw", "1f1b", "zb-h1", "gpipe", "zb-h2", "zb-v"} <= {c["schedule"] for c in scored}
    assert plan.extra["simulated_time_per_minibatch"] == \
        pytest.approx(min(c["simulated_time_per_minibatch"] for c in scored), rel=1e-9)


def test_auto_picks_a_schedule_that_fits(vgg):
    plain = make_plan(vgg, Topology.flat(4))
    limit = 0.5 * max(s.memory_bytes for s in plain.stages)
    plan = make_plan(vgg, Topology.flat(4), schedule="auto", memory_limit=limit)
    assert max(s.memory_bytes for s in plan.stages) <= limit
    assert plan.schedule != "pipedream"     # pipedream's stashing needs more than half
    with pytest.raises(PipetrainError, match="smallest memory limit that fits is"):
        make_plan(vgg, Topology.flat(4), schedule="auto", memory_limit=1e6)


def test_microbatches_default_to_workers(vgg):
    plan = make_plan(vgg, Topology.flat(4), schedule="1f1b")
    assert plan.microbatches == 4
    assert plan.time_per_minibatch_with_bubble == pytest.approx(
        plan.predicted_time_per_minibatch * (4 + len(plan.stages) - 1) / 4)


def test_compare_baselines(vgg):
    plans = compare_baselines(vgg, Topology.flat(4))
    assert [p.method for p in plans] == ["uniform", "balanced-by-parameters",
                                         "balanced-by-time"]
    assert all(len(p.stages) == 4 for p in plans)


def blocks(count: int = 8) -> "Profile":
    """A chain whose even layers hold wide activations and whose odd layers send narrow ones (an
    MLP block that expands, then projects): cheap inputs, expensive insides, so recomputing a
    stage saves most of what it holds. Forward 1 s, backward 2 s per layer."""
    from pipetrain.plan.profile import LayerProfile, Profile

    layers = [LayerProfile("in", input=True, activation_bytes=100)]
    layers += [LayerProfile(f"l{i}", forward_s=1.0, backward_s=2.0, activation_bytes=1000 if i % 2 == 0 else 100,
                            parameter_bytes=10, optimizer_bytes=20) for i in range(count)]
    return Profile(layers)


def test_the_planner_recomputes_the_stages_that_would_not_fit_and_pays_their_forward():
    """1F1B over 4 workers, 4 microbatches: stage s holds min(4 - s, 4) microbatches of a stage's
    activations (a quarter of 1100 bytes for two layers), so 600 bytes fit no plan that keeps
    them all (the smallest limit is 670). With recomputation the first three stages of two
    layers each keep their inputs instead (25 bytes a microbatch after an odd layer) and one
    microbatch's activations: 335 to 410 bytes; the last, holding one microbatch anyway, keeps
    its activations. Each recomputing stage takes 2 x (1 + 2) s plus its forward of 2 s again."""
    profile = blocks()
    with pytest.raises(PipetrainError, match=r"smallest memory limit that fits is 670 B .*raise memory_limit to at "
                       r"least that.*recompute their activations \(recompute=True\)") as info:
        make_plan(profile, Topology.flat(4), schedule="1f1b", microbatches=4, memory_limit=600)
    assert info.value.options == ("memory_limit", "recompute")
    plan = make_plan(profile, Topology.flat(4), schedule="1f1b", microbatches=4, memory_limit=600, recompute=True)
    assert plan.replicas == [1, 1, 1, 1]
    assert [s.recompute for s in plan.stages] == [True, True, True, False]
    assert [s.recompute_s for s in plan.stages] == [2.0, 2.0, 2.0, 0.0]
    assert [s.compute_s for s in plan.stages] == [6.0] * 4  # forward and backward once
    assert [s.time_s for s in plan.stages] == [8.0, 8.0, 8.0, 6.0]
    assert plan.predicted_time_per_minibatch == 8.0
    assert [s.memory_bytes for s in plan.stages] == [335.0, 410.0, 385.0, 335.0]
    assert all(s.memory_bytes <= 600 for s in plan.stages)
    data = plan.to_json()
    assert data["recompute_stages"] == [0, 1, 2] and [s["recompute"] for s in data["stages"]] == [True] * 3 + [False]
    # where everything fits as it is, nothing recomputes
    roomy = make_plan(profile, Topology.flat(4), schedule="1f1b", microbatches=4, memory_limit=3000, recompute=True)
    assert not any(s.recompute for s in roomy.stages) and roomy.predicted_time_per_minibatch == 6.0
    # tighter than the recomputing plan's smallest (its largest stage, 410): refused, naming it
    with pytest.raises(PipetrainError, match="1f1b with recomputation; the smallest memory limit that fits is 410 B"):
        make_plan(profile, Topology.flat(4), schedule="1f1b", microbatches=4, memory_limit=300, recompute=True)


def test_the_schedule_search_simulates_the_recomputed_forward():
    """schedule auto: each candidate's plan may recompute; the simulation runs a recomputing
    stage's forward again before its backward, and counts the inputs it keeps."""
    from pipetrain.plan.search import simulate_plan

    profile = blocks()
    topology = Topology.flat(4)
    plan = make_plan(profile, topology, schedule="auto", microbatches=4, memory_limit=600, recompute=True)
    assert any(s.recompute for s in plan.stages)
    assert max(s.memory_bytes for s in plan.stages) <= 600
    chosen = [c for c in plan.extra["schedule_candidates"] if c.get("fits") and c["schedule"] == plan.schedule]
    assert chosen[0]["recompute_stages"] == [s for s, stage in enumerate(plan.stages) if stage.recompute]
    recomputing = simulate_plan(plan, profile, topology)
    for stage in plan.stages:
        stage.recompute = False  # the same cut keeping every activation: faster, and over the limit
    kept = simulate_plan(plan, profile, topology)
    assert recomputing.time_per_minibatch > kept.time_per_minibatch
    assert max(recomputing.memory_bytes) <= 600 < max(kept.memory_bytes)
