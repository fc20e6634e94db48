"""Baseline partitioners: block partition optimality, pricing, comparison with the optimizer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.errors import ConfigError
from pipetrain.plan.baselines import BASELINES, baseline, block_partition
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.topology import Topology

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


def brute_block(weights, parts):
    n = len(weights)
    best = float("inf")
    for cut in itertools.combinations(range(1, n), parts - 1):
        bounds = (0,) + cut + (n,)
        best = min(best, max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(parts)))
    return best


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=9), st.data())
def test_block_partition_is_optimal(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    bounds = block_partition(weights, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    got = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(parts))
    assert got == pytest.approx(brute_block(weights, parts), rel=1e-12, abs=1e-12)


def test_block_partition_rejects_too_many_parts():
    with pytest.raises(ConfigError):
        block_partition([1.0, 2.0], 3)


def chain(values):
    return Profile([LayerProfile(name=f"l{i}", forward_s=c, parameter_bytes=p,
                                 activation_bytes=a) for i, (c, p, a) in enumerate(values)])


def test_uniform_balanced_and_priced():
    profile = chain([(1.0, 0, 0), (1.0, 0, 0), (1.0, 0, 0), (5.0, 0, 0)])
    uniform = baseline("uniform", profile, 2)
    assert [len(s.layers) for s in uniform.stages] == [2, 2]
    assert uniform.predicted_time_per_minibatch == pytest.approx(6.0)
    by_time = baseline("time", profile, 2)
    assert [len(s.layers) for s in by_time.stages] == [3, 1]
    assert by_time.predicted_time_per_minibatch == pytest.approx(5.0)
    by_params = baseline("parameters", chain([(1, 9, 0), (1, 1, 0), (1, 1, 0)]), 2)
    assert [len(s.layers) for s in by_params.stages] == [1, 2]


def test_baseline_transfers_follow_cost_model():
    # two layers, 1e9 bytes cross the cut at 1e9 B/s: 2 s each way (pipedream-code, r' = 1)
    profile = chain([(0.5, 0, 1e9), (0.5, 0, 0)])
    plan = baseline("uniform", profile, 2)
    assert plan.predicted_time_per_minibatch == pytest.approx(2.0)
    assert plan.stages[1].input_transfer_s == pytest.approx(2.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 4e8), st.floats(0.0, 4e8)),
                min_size=1, max_size=8), st.integers(1, 5),
       st.sampled_from(["pipedream-code", "paper"]))
def test_optimizer_never_worse_than_baselines_on_chains(values, workers, model):
    profile = chain(values)
    best = optimize(profile, workers, cost_model=model, straight=True, fewer_machines=True)
    for method in BASELINES:
        plan = baseline(method, profile, workers, cost_model=model)
        assert best.predicted_time_per_minibatch <= \
            plan.predicted_time_per_minibatch * (1 + 1e-12)


@pytest.mark.parametrize("method", BASELINES)
def test_baselines_on_dag_profile(method):
    profile = parse_graph_txt((PROFILES / "resnet18.txt").read_text())
    plan = baseline(method, profile, Topology((2, 4), (1e10, 1e9)))
    assert len(plan.stages) == 8 and plan.replicas == [1] * 8
    names = [n for s in plan.stages for n in s.layers]
    assert sorted(names) == sorted(layer.name for layer in profile.layers)
    where = plan.layer_to_stage()
    assert all(where[a] <= where[b] for a, b in profile.edge_list())
    assert plan.predicted_time_per_minibatch >= optimize(
        profile, Topology((2, 4), (1e9, 1e9))).predicted_time_per_minibatch
