"""The planner front door: schedule choice and baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.errors import PipetrainError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.planner import compare_baselines, make_plan
from pipetrain.plan.topology import Topology

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


@pytest.fixture(scope="module")
def vgg():
    return parse_graph_txt((PROFILES / "vgg16.txt").read_text())


def test_auto_picks_the_fastest_simulated_candidate(vgg):
    plan = make_plan(vgg, Topology.flat(4), schedule="auto")
    scored = [c for c in plan.extra["schedule_candidates"] if "error" not in c]
    assert {c["schedule"] for c in scored} == {"pipedream", "2bw", "1f1b", "zb-h1", "gpipe"}
    assert plan.extra["simulated_time_per_minibatch"] == \
        min(c["simulated_time_per_minibatch"] for c in scored)


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
