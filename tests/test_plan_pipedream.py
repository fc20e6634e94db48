"""PipeDream's optimizer: the published reference predictions, brute force, sanity properties."""

from __future__ import annotations

import functools
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrain.errors import PipetrainError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.stage_memory import stage_memory
from pipetrain.plan import level as dp_level
from pipetrain.plan import mirror as dp_mirror
from pipetrain.plan import solver as dp_solver
from pipetrain.plan.graph import build_cuts
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.topology import Topology
from pipetrain.plan.window import nested_ranges

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


@functools.lru_cache(maxsize=None)
def load(name: str) -> Profile:
    return parse_graph_txt((PROFILES / f"{name}.txt").read_text(), where=name)


# The table of tests/data/pipedream-profiles/README.md (the public optimizer's predictions):
# profile, machines per level, bandwidths, straight, replicas, 1-worker time, predicted time,
# speedup vs 1 worker, speedup vs N-way data parallelism.
REFERENCE = [
    ("vgg16", (2,), None, False, [1, 1], 0.672535, 0.411041792, 1.636, 2.164),
    ("vgg16", (4,), None, False, [3, 1], 0.672535, 0.205520896, 3.272, 2.838),
    ("vgg16", (8,), None, False, [7, 1], 0.672535, 0.103833170, 6.477, 3.142),
    ("vgg16", (16,), None, False, [13, 2, 1], 0.672535, 0.056529767, 11.897, 3.038),
    ("vgg16", (4,), None, True, [1, 1, 1, 1], 0.672535, 0.411041792, 1.636, 1.419),
    ("alexnet", (4,), None, False, [3, 1], 0.085321, 0.034217141, 2.494, 5.980),
    ("gnmt", (4,), None, False, [1, 1, 1, 1], 0.089416, 0.025868, 3.457, 23.336),
    ("vgg16", (4, 4), (10e9, 1.25e9), False, None, 0.672535, 0.067133997, 10.018, 2.017),
]


@pytest.mark.parametrize("name,machines,bandwidths,straight,replicas,single,predicted,"
                         "speedup,vs_dp", REFERENCE)
def test_reproduces_reference_table(name, machines, bandwidths, straight, replicas, single,
                                    predicted, speedup, vs_dp):
    topology = Topology(machines, bandwidths or (1e9,) * len(machines))
    plan = optimize(load(name), topology, cost_model="pipedream-code", straight=straight)
    # the table prints 9 significant digits
    assert plan.predicted_time_per_minibatch == pytest.approx(predicted, rel=1e-6, abs=1e-9)
    assert plan.single_worker_time == pytest.approx(single, rel=1e-6)
    assert single / plan.predicted_time_per_minibatch == pytest.approx(speedup, abs=6e-4)
    assert plan.data_parallel_time / plan.predicted_time_per_minibatch == \
        pytest.approx(vs_dp, abs=6e-4)
    if replicas is not None:
        assert plan.replicas == replicas
    assert plan.workers_used == math.prod(machines)
    assert max(s.time_s for s in plan.stages) <= plan.predicted_time_per_minibatch * (1 + 1e-12)


def test_exact_reference_values():
    """Full-precision values of the public optimizer on the same profiles."""
    assert optimize(load("vgg16"), 16).predicted_time_per_minibatch == \
        pytest.approx(0.056529767384615376, rel=1e-12)
    assert optimize(load("vgg16"), 8).predicted_time_per_minibatch == \
        pytest.approx(0.1038331702857143, rel=1e-12)
    hier = optimize(load("vgg16"), Topology((4, 4), (10e9, 1.25e9)))
    assert hier.predicted_time_per_minibatch == pytest.approx(0.06713399693333331, rel=1e-12)


@pytest.mark.parametrize("name,workers,time,replicas", [
    ("resnet50", 16, 0.04780134530612245, [7, 6, 3]),
    ("gnmt_large", 4, 0.13712900000000006, [1, 1, 1, 1]),
    ("resnet18", 8, 0.05078332703999999, [5, 3]),
    ("gnmt", 8, 0.01928500000000001, [1] * 8),
])
def test_dag_profiles_match_reference(name, workers, time, replicas):
    plan = optimize(load(name), workers)
    assert plan.predicted_time_per_minibatch == pytest.approx(time, rel=1e-9)
    assert plan.replicas == replicas


def test_plan_covers_every_layer_once():
    profile = load("resnet50")
    plan = optimize(profile, 16)
    names = [name for stage in plan.stages for name in stage.layers]
    assert sorted(names) == sorted(layer.name for layer in profile.layers)
    # inputs sit in stage 0
    inputs = [layer.name for layer in profile.layers if layer.input]
    assert all(plan.layer_to_stage()[name] == 0 for name in inputs)
    # every edge goes forward (or stays) in stage order: stages are cut at antichains
    where = plan.layer_to_stage()
    assert all(where[a] <= where[b] for a, b in profile.edge_list())


def test_noam_and_json():
    plan = optimize(load("vgg16"), 16)
    assert plan.noam == math.ceil(16 / 13)
    data = plan.to_json()
    assert data["replicas"] == [13, 2, 1]
    assert data["num_stages"] == 3 and len(data["stages"]) == 3
    assert data["predicted_time_per_minibatch"] == plan.predicted_time_per_minibatch
    assert data["solve_seconds"] >= 0


def test_paper_model_is_no_slower_than_code_model():
    for name, workers in [("vgg16", 4), ("alexnet", 8), ("resnet18", 4)]:
        code = optimize(load(name), workers, cost_model="pipedream-code")
        paper = optimize(load(name), workers, cost_model="paper")
        # max(compute, sync) <= compute + sync, transfers not divided by replicas though
        assert paper.predicted_time_per_minibatch > 0
        assert code.predicted_time_per_minibatch > 0


# ----------------------------------------------------------------------------- brute force

def chain(compute, params, acts, optim=None) -> Profile:
    optim = optim or [0.0] * len(compute)
    return Profile([LayerProfile(name=f"l{i}", forward_s=c / 3, backward_s=2 * c / 3,
                                 parameter_bytes=p, activation_bytes=a, optimizer_bytes=o)
                    for i, (c, p, a, o) in enumerate(zip(compute, params, acts, optim))])


def compositions(total: int, parts: int):
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cut + (total,)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(compute, params, acts, workers, bandwidth, model, straight=False,
                fewer=False, memory=None, optim=None, schedule="pipedream", recompute=False,
                microbatches=1):
    """Every partition of the chain and every replica assignment, priced directly; with
    ``recompute``, a stage that does not fit ``memory`` as it is may recompute (its input, the
    previous layer's output, kept per unit; its forward, a third of :func:`chain`'s compute, again)."""
    n = len(compute)
    optim = optim or [0.0] * n
    c = [sum(compute[:i]) for i in range(n + 1)]
    f = [sum(x / 3 for x in compute[:i]) for i in range(n + 1)]
    best = math.inf
    totals = range(1, workers + 1) if fewer else [workers]
    for ncuts in range(0, n):
        for cut in itertools.combinations(range(1, n), ncuts):
            bounds = (0,) + cut + (n,)
            stages = len(bounds) - 1
            for total in totals:
                if total < stages:
                    continue
                for reps in compositions(total, stages):
                    if straight and any(r != 1 for r in reps):
                        continue
                    worst = 0.0
                    before = 0
                    ok = True
                    for s in range(stages):
                        lo, hi, r = bounds[s], bounds[s + 1], reps[s]
                        comp = c[hi] - c[lo]
                        par = sum(params[lo:hi])
                        if memory is not None:
                            def mem(again):
                                return stage_memory(schedule, parameter_bytes=par,
                                                    optimizer_bytes=sum(optim[lo:hi]),
                                                    activation_bytes=sum(acts[lo:hi]),
                                                    workers_from_here=total - before, replicas=r,
                                                    microbatches=microbatches, recompute=again,
                                                    input_bytes=acts[lo - 1] if lo else 0.0)

                            if mem(False) > memory and recompute and mem(True) <= memory:
                                comp = comp + (f[hi] - f[lo])
                        sync = 4 * (r - 1) * par / (bandwidth * r)
                        if model == "paper":
                            t = max(comp, sync) / r
                            if s >= 1:
                                t = max(t, 2 * acts[lo - 1] / bandwidth)
                        else:
                            t = (comp + sync) / r
                            if s >= 1:
                                t = max(t, 2 * acts[lo - 1] / (bandwidth * r))
                                if s < stages - 1:
                                    t = max(t, 2 * acts[hi - 1] / (bandwidth * r))
                        if memory is not None:
                            ok = ok and (mem(False) <= memory or (recompute and mem(True) <= memory))
                        before += r
                        worst = max(worst, t)
                    if ok:
                        best = min(best, worst)
    return best


layer_values = st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 4e8),
                                  st.floats(0.0, 4e8)), min_size=1, max_size=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=layer_values, workers=st.integers(1, 5),
       bandwidth=st.sampled_from([1e8, 1e9, 1e10]),
       model=st.sampled_from(["pipedream-code", "paper"]),
       straight=st.booleans(), fewer=st.booleans())
def test_optimizer_equals_brute_force(layers, workers, bandwidth, model, straight, fewer):
    compute, params, acts = (list(x) for x in zip(*layers))
    expected = brute_force(compute, params, acts, workers, bandwidth, model, straight, fewer)
    topology = Topology.flat(workers, bandwidth)
    if not math.isfinite(expected):
        with pytest.raises(PipetrainError):
            optimize(chain(compute, params, acts), topology, cost_model=model,
                     straight=straight, fewer_machines=fewer)
        return
    plan = optimize(chain(compute, params, acts), topology, cost_model=model,
                    straight=straight, fewer_machines=fewer)
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-9, abs=1e-15)
    if not fewer:
        assert plan.workers_used == workers
    assert plan.workers_used <= workers
    if straight:
        assert all(r == 1 for r in plan.replicas)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=layer_values, workers=st.integers(1, 5), fraction=st.floats(0.05, 1.0),
       schedule=st.sampled_from(["pipedream", "2bw", "1f1b"]), fewer=st.booleans())
def test_memory_limited_optimizer_equals_brute_force(layers, workers, fraction, schedule, fewer):
    compute, params, acts = (list(x) for x in zip(*layers))
    optim = [p / 2 for p in params]
    # a limit somewhere between nothing fits and everything fits
    limit = fraction * (workers * sum(params) + sum(optim) + workers * sum(acts)) + 1.0
    expected = brute_force(compute, params, acts, workers, 1e9, "pipedream-code", fewer=fewer,
                           memory=limit, optim=optim, schedule=schedule)
    profile = chain(compute, params, acts, optim)
    if not math.isfinite(expected):
        with pytest.raises(PipetrainError, match="smallest memory limit that fits"):
            optimize(profile, workers, memory_limit=limit, schedule=schedule, fewer_machines=fewer)
        return
    plan = optimize(profile, workers, memory_limit=limit, schedule=schedule, fewer_machines=fewer)
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert max(stage.memory_bytes for stage in plan.stages) <= limit


def smallest_limit(profile, workers, **options) -> float:
    """The smallest memory limit that fits, as the planner's refusal of one byte says (to the
    nearest byte: the limit itself is within half a byte of it), or ``inf``."""
    try:
        optimize(profile, workers, memory_limit=1.0, **options)
    except PipetrainError as error:
        found = re.search(r"\((\d+) bytes\)", str(error))
        return float(found.group(1)) if found else math.inf
    return 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=layer_values, workers=st.integers(2, 5), fraction=st.floats(0.0, 1.2),
       schedule=st.sampled_from(["pipedream", "2bw", "1f1b", "gpipe"]), fewer=st.booleans())
def test_memory_limited_optimizer_with_recomputation_equals_brute_force(layers, workers, fraction,
                                                                        schedule, fewer):
    """Stages that do not fit may recompute: the fastest plan over every partition, replica
    assignment and such choice, never slower than without recomputation. The limits drawn lie
    mostly between the smallest that fit with and without recomputation, where it matters."""
    compute, params, acts = (list(x) for x in zip(*layers))
    optim = [p / 2 for p in params]
    profile = chain(compute, params, acts, optim)
    m = 1 if schedule == "pipedream" else 4
    options = dict(schedule=schedule, fewer_machines=fewer, microbatches=m)
    low = smallest_limit(profile, workers, recompute=True, **options) + 0.5
    high = smallest_limit(profile, workers, **options) + 0.5  # (both limits now fit)
    assert low <= high
    limit = low + fraction * (high - low) if math.isfinite(high) else low * (1 + fraction)
    expected = brute_force(compute, params, acts, workers, 1e9, "pipedream-code", fewer=fewer,
                           memory=limit, optim=optim, schedule=schedule, recompute=True,
                           microbatches=m)
    if not math.isfinite(expected):
        with pytest.raises(PipetrainError, match="with recomputation; the smallest memory limit that fits"):
            optimize(profile, workers, memory_limit=limit, recompute=True, **options)
        return
    plan = optimize(profile, workers, memory_limit=limit, recompute=True, **options)
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert max(stage.memory_bytes for stage in plan.stages) <= limit
    assert max(stage.time_s for stage in plan.stages) <= plan.predicted_time_per_minibatch * (1 + 1e-9) + 1e-15
    for stage in plan.stages:  # the forward again is in the stage's time, where it recomputes
        forward = sum(layer.forward_s for layer in profile.layers if layer.name in stage.layers)
        assert stage.recompute_s == (pytest.approx(forward, rel=1e-9, abs=1e-15) if stage.recompute else 0.0)
    if limit < high - 1.0:  # below the smallest that fits without: some stage recomputes
        with pytest.raises(PipetrainError, match="smallest memory limit that fits"):
            optimize(profile, workers, memory_limit=limit, **options)
        assert any(stage.recompute for stage in plan.stages)
    elif limit >= high:
        kept = optimize(profile, workers, memory_limit=limit, **options)
        assert plan.predicted_time_per_minibatch <= kept.predicted_time_per_minibatch * (1 + 1e-12)


def test_memory_error_names_smallest_limit_that_fits():
    profile = load("vgg16")
    with pytest.raises(PipetrainError) as info:
        optimize(profile, 4, memory_limit=1e6)
    message = str(info.value)
    assert "smallest memory limit that fits" in message
    smallest = float(message.split("(")[1].split(" bytes")[0])
    plan = optimize(profile, 4, memory_limit=smallest)
    assert max(stage.memory_bytes for stage in plan.stages) <= smallest
    with pytest.raises(PipetrainError):
        optimize(profile, 4, memory_limit=smallest * (1 - 1e-9))


# ----------------------------------------------------------------------------- properties

@settings(max_examples=40, deadline=None)
@given(layers=layer_values, workers=st.integers(1, 6),
       model=st.sampled_from(["pipedream-code", "paper"]))
def test_infinite_bandwidth_gives_total_compute_over_workers(layers, workers, model):
    compute, params, acts = (list(x) for x in zip(*layers))
    plan = optimize(chain(compute, params, acts), Topology.flat(workers, math.inf),
                    cost_model=model)
    assert plan.predicted_time_per_minibatch == pytest.approx(sum(compute) / workers,
                                                              rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name", ["resnet18", "vgg16", "gnmt"])
def test_infinite_bandwidth_on_dags(name):
    profile = load(name)
    plan = optimize(profile, Topology((2, 3), (math.inf, math.inf)))
    assert plan.predicted_time_per_minibatch == pytest.approx(profile.total_compute_s / 6,
                                                              rel=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=layer_values, workers=st.integers(1, 7),
       bandwidth=st.sampled_from([1e8, 1e9, 1e10]),
       model=st.sampled_from(["pipedream-code", "paper"]), straight=st.booleans())
def test_more_workers_never_worse_with_idle_workers_allowed(layers, workers, bandwidth, model,
                                                            straight):
    compute, params, acts = (list(x) for x in zip(*layers))
    profile = chain(compute, params, acts)
    times = [optimize(profile, Topology.flat(n, bandwidth), cost_model=model, straight=straight,
                      fewer_machines=True).predicted_time_per_minibatch
             for n in (workers, workers + 1)]
    assert times[1] <= times[0]


def test_more_workers_never_worse_on_real_profile():
    profile = load("resnet18")
    times = [optimize(profile, n, fewer_machines=True).predicted_time_per_minibatch
             for n in range(1, 9)]
    assert all(b <= a for a, b in zip(times, times[1:]))


# ----------------------------------------------------------------------------- hierarchy

def naive_hierarchical(compute, params, acts, machines, bandwidths, fewer=False):
    """The level recurrence written out with plain loops (pipedream-code model)."""
    n = len(compute)
    c = [sum(compute[:i]) for i in range(n + 1)]
    p = [sum(params[:i]) for i in range(n + 1)]

    @functools.lru_cache(maxsize=None)
    def best(level, r, j, mach):
        if mach < 1:
            return math.inf
        bw = bandwidths[level]
        within = machines[level - 1] if level else 1
        base = (lambda a, b: c[b] - c[a]) if level == 0 else \
            (lambda a, b: best(level - 1, a, b, machines[level - 1]))
        value = (base(r, j) + 4 * (mach - 1) * (p[j] - p[r]) / (bw * mach) / within) / mach
        if fewer and mach > 1:
            value = min(value, best(level, r, j, mach - 1))
        for k in range(r + 1, j):
            for m in range(1, mach):
                last = (base(k, j) + 4 * (m - 1) * (p[j] - p[k]) / (bw * m)) / m
                t = max(best(level, r, k, mach - m), last, 2 * acts[k - 1] / (bw * m))
                if j < n:
                    t = max(t, 2 * acts[j - 1] / (bw * m))
                value = min(value, t)
        return value

    top = len(machines) - 1
    return best(top, 0, n, machines[top])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 4e8),
                                 st.floats(0.0, 4e8)), min_size=1, max_size=7),
       machines=st.lists(st.integers(1, 3), min_size=2, max_size=3),
       fewer=st.booleans())
def test_hierarchical_equals_naive_recurrence(layers, machines, fewer):
    compute, params, acts = (list(x) for x in zip(*layers))
    bandwidths = [1e10, 1e9, 2e8][:len(machines)]
    expected = naive_hierarchical(compute, params, acts, machines, bandwidths, fewer)
    plan = optimize(chain(compute, params, acts), Topology(tuple(machines), tuple(bandwidths)),
                    fewer_machines=fewer)
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert plan.workers_used <= math.prod(machines)
    # the flattened stages' own times never exceed the prediction
    assert max(s.time_s for s in plan.stages) <= plan.predicted_time_per_minibatch * (1 + 1e-9)


def test_long_chain_uses_fast_kernel_and_matches_dense():
    rng = np.random.default_rng(0)
    n = 60
    compute = list(rng.uniform(0.001, 0.01, n))
    params = list(rng.uniform(0, 5e7, n))
    acts = list(rng.uniform(0, 5e6, n))
    profile = chain(compute, params, acts)
    topology = Topology((3, 4), (1e10, 1e9))
    plan = optimize(profile, topology)
    expected = naive_hierarchical(compute, params, acts, (3, 4), (1e10, 1e9))
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-12)


def test_three_levels_on_a_longer_chain_match_naive_recurrence():
    rng = np.random.default_rng(3)
    n = 26
    compute = list(rng.uniform(0.001, 0.01, n))
    params = list(rng.uniform(0, 8e7, n))
    acts = list(rng.uniform(0, 2e7, n))
    machines, bandwidths = (2, 2, 3), (1e10, 1e9, 1e8)
    plan = optimize(chain(compute, params, acts), Topology(machines, bandwidths))
    expected = naive_hierarchical(compute, params, acts, machines, bandwidths)
    assert plan.predicted_time_per_minibatch == pytest.approx(expected, rel=1e-12)


def plan_signature(plan):
    return (plan.predicted_time_per_minibatch, plan.replicas,
            [(s.layers, s.replicas_per_level, s.time_s, s.recompute) for s in plan.stages])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), layers=st.integers(8, 70),
       machines=st.sampled_from([(2, 3), (3, 4), (2, 2, 3), (4, 2, 2), (2, 8), (1, 5)]),
       model=st.sampled_from(["pipedream-code", "paper"]), fewer=st.booleans(),
       straight=st.booleans(), spread=st.sampled_from([1.0, 10.0, 1000.0]))
def test_banded_chain_solve_equals_full_solve(seed, layers, machines, model, fewer, straight,
                                              spread):
    """Multi-level chains are solved in a band of short ranges: same plan as the full DP, whether
    the first bound holds (one pass) or not (more passes)."""
    rng = np.random.default_rng(seed)
    compute = list(rng.uniform(1e-3, 1e-3 * spread, layers))
    params = list(rng.uniform(0, 5e7, layers))
    acts = list(rng.uniform(0, 5e6, layers))
    profile = chain(compute, params, acts)
    topology = Topology(machines, (1e10, 1e9, 1e8)[:len(machines)])
    options = dict(cost_model=model, fewer_machines=fewer, straight=straight)
    results = []
    for start in (math.inf, 2.0, 0.5, 1.0 + 1e-12):     # inf: no band
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dp_solver, "BAND_START", start)
            try:
                results.append(plan_signature(optimize(profile, topology, **options)))
            except PipetrainError as error:
                results.append(str(error))
    assert all(result == results[0] for result in results[1:])


def test_band_is_narrow_on_a_long_chain_over_many_workers():
    rng = np.random.default_rng(0)
    n = 300
    profile = chain(list(rng.uniform(1e-3, 1e-2, n)), list(rng.uniform(0, 5e7, n)),
                    list(rng.uniform(0, 5e6, n)))
    topology = Topology((4, 4, 16), (1e10, 1e9, 1e8))
    cuts = build_cuts(profile)
    planner = dp_solver.Solver(cuts, topology, "pipedream-code", False, False,
                               dp_level.MemoryBudget(None, "pipedream", 1, topology.workers))
    value = planner.solve()
    band = planner._band(value)
    nested = nested_ranges(band, cuts.ancestors, True)
    # the last level may use a few hundred of its 45,150 ranges, inner levels solve well under
    # a quarter of theirs
    assert band.sum() < 2_000 and nested.sum() < cuts.ancestors.sum() / 4
    # every last-level stage of the optimal plan is in the band of its time
    for _, _, path in planner.stages():
        _, _, start, end = path[-1]
        assert band[start, end]
    assert optimize(profile, topology).predicted_time_per_minibatch == value


def residual(blocks: int, seed: int) -> Profile:
    """A residual network: per block two layers and an add that also takes the block's input."""
    rng = np.random.default_rng(seed)
    layers, edges, before = [LayerProfile("input", input=True)], [], "input"
    for b in range(blocks):
        names = [f"{b}a", f"{b}b", f"{b}add"]
        for name in names[:2]:
            layers.append(LayerProfile(name, forward_s=float(rng.uniform(1e-3, 1e-2)),
                                       parameter_bytes=float(rng.uniform(0, 5e7)),
                                       activation_bytes=float(rng.uniform(1e5, 5e6))))
        layers.append(LayerProfile(names[2], forward_s=1e-5,
                                   activation_bytes=float(rng.uniform(1e5, 5e6))))
        edges += [(before, names[0]), (names[0], names[1]), (names[1], names[2]),
                  (before, names[2])]
        before = names[2]
    return Profile(layers, edges=edges)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), blocks=st.integers(2, 12),
       machines=st.sampled_from([(2, 3), (3, 4), (2, 2, 3), (2, 8), (1, 5), (4, 1)]),
       model=st.sampled_from(["pipedream-code", "paper"]), fewer=st.booleans(),
       straight=st.booleans())
def test_banded_dag_solve_equals_full_solve(seed, blocks, machines, model, fewer, straight):
    """DAG profiles over several levels are solved in a band too: same plan as the full DP,
    with the passes of a growing bound or a jump to data parallelism's."""
    profile = residual(blocks, seed)
    topology = Topology(machines, (1e10, 1e9, 1e8)[:len(machines)])
    options = dict(cost_model=model, fewer_machines=fewer, straight=straight)
    results = []
    for start, jump in ((math.inf, 0.5), (2.0, 0.5), (2.0, 2.0), (0.5, 2.0)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dp_solver, "BAND_START", start)
            patch.setattr(dp_solver, "BAND_JUMP", jump)
            try:
                results.append(plan_signature(optimize(profile, topology, **options)))
            except PipetrainError as error:
                results.append(str(error))
    assert all(result == results[0] for result in results[1:])


def state_bytes(profile: Profile) -> float:
    return sum(l.parameter_bytes + l.optimizer_bytes + l.activation_bytes for l in profile.layers)


def random_profile(seed: int, dag: bool) -> Profile:
    rng = np.random.default_rng(seed)
    if dag:
        return residual(int(rng.integers(1, 8)), seed)
    layers = int(rng.integers(1, 14))
    return chain(list(rng.uniform(1e-3, 1e-2, layers)), list(rng.uniform(0, 5e8, layers)),
                 list(rng.uniform(0, 5e7, layers)), list(rng.uniform(0, 5e8, layers)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dag=st.booleans(), workers=st.integers(2, 80),
       model=st.sampled_from(["pipedream-code", "paper"]), fewer=st.booleans(),
       straight=st.booleans(), memory=st.sampled_from([None, 0.3, 1.0, 3.0]),
       schedule=st.sampled_from(["pipedream", "2bw", "1f1b"]),
       bandwidth=st.sampled_from([1e8, 1e9, 1e10]), recompute=st.booleans())
def test_windowed_solve_equals_the_whole_table(seed, dag, workers, model, fewer, straight,
                                               memory, schedule, bandwidth, recompute):
    """Many workers: the last level is solved in machine-count windows from a bound (with a
    memory limit, widened from the plan without it): same plan as the whole table, also where
    stages may recompute."""
    profile = random_profile(seed, dag)
    limit = None if memory is None else memory * state_bytes(profile)
    options = dict(cost_model=model, fewer_machines=fewer, straight=straight,
                   memory_limit=limit, schedule=schedule,
                   microbatches=1 if schedule == "pipedream" else 4, recompute=recompute)
    results = []
    for threshold in (10**9, 1):
        with pytest.MonkeyPatch.context() as patch:
            for module in (dp_level, dp_solver, dp_mirror):
                patch.setattr(module, "WINDOW_MACHINES", threshold)
            try:
                results.append(plan_signature(optimize(profile, Topology.flat(workers,
                                                                              bandwidth),
                                                       **options)))
            except PipetrainError as error:
                results.append(str(error))
    assert results[0] == results[1]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dag=st.booleans(), workers=st.integers(1, 12),
       model=st.sampled_from(["pipedream-code", "paper"]), straight=st.booleans(),
       memory=st.sampled_from([0.05, 0.3, 1.0, 3.0]),
       schedule=st.sampled_from(["pipedream", "2bw", "1f1b", "gpipe"]), recompute=st.booleans())
def test_idle_workers_with_a_memory_limit_equal_one_solve_per_count(seed, dag, workers,
                                                                     model, straight, memory,
                                                                     schedule, recompute):
    """The DP built from the end gives every worker count's time at once: the plan is the
    fastest count's own plan (the first of equally fast counts), as solving each would; also
    where stages may recompute (the reversed model keeps each stage's input)."""
    profile = random_profile(seed, dag)
    limit = memory * state_bytes(profile) + 1.0
    options = dict(cost_model=model, straight=straight, memory_limit=limit, schedule=schedule,
                   microbatches=1 if schedule == "pipedream" else 4, recompute=recompute)
    each = []
    for n in range(1, workers + 1):
        try:
            each.append(optimize(profile, Topology.flat(n), **options))
        except PipetrainError:
            each.append(None)
    found = [p for p in each if p is not None]
    if not found:
        with pytest.raises(PipetrainError, match="smallest memory limit that fits"):
            optimize(profile, Topology.flat(workers), fewer_machines=True, **options)
        return
    best = min(found, key=lambda p: p.predicted_time_per_minibatch)   # first of the fastest
    plan = optimize(profile, Topology.flat(workers), fewer_machines=True, **options)
    assert plan_signature(plan) == plan_signature(best)
    assert plan.workers_used == best.workers


# Values of the solver before the machine-count sweep (fdb67d3, 13.8 s, 103 s and 20 s there)
@pytest.mark.parametrize("name,machines,bandwidths,time,replicas", [
    ("vgg16", (1024,), (1e9,), 0.002811764902825484, [265, 54, 587, 95, 23]),
    ("resnet50", (1024,), (1e9,), 0.0008310086560753533, [455, 312, 217, 40]),
    ("resnet50", (32, 32), (10e9, 1e9), 0.00084258975546875,
     [96, 416, 128, 64, 64, 64, 96, 64, 32]),
])
def test_large_plans_equal_the_earlier_solver(name, machines, bandwidths, time, replicas):
    plan = optimize(load(name), Topology(machines, bandwidths))
    assert plan.predicted_time_per_minibatch == pytest.approx(time, rel=1e-12)
    assert plan.replicas == replicas


@pytest.mark.parametrize("name,machines,bandwidths,straight,replicas,single,predicted,"
                         "speedup,vs_dp", REFERENCE)
def test_reference_table_in_machine_windows(monkeypatch, name, machines, bandwidths, straight,
                                            replicas, single, predicted, speedup, vs_dp):
    """The reference table again, with the windows of large worker counts used at every size."""
    for module in (dp_level, dp_solver, dp_mirror):
        monkeypatch.setattr(module, "WINDOW_MACHINES", 1)
    topology = Topology(machines, bandwidths or (1e9,) * len(machines))
    plan = optimize(load(name), topology, cost_model="pipedream-code", straight=straight)
    assert plan.predicted_time_per_minibatch == pytest.approx(predicted, rel=1e-6, abs=1e-9)
    if replicas is not None:
        assert plan.replicas == replicas


@pytest.mark.parametrize("name,machines,bandwidths,time", [
    ("gnmt", (2, 4), (10e9, 1e9), 0.017954),
    ("gnmt", (4, 2), (10e9, 1e9), 0.017125),
    ("resnet18", (2, 2, 2), (1e10, 1e9, 1e8), 0.087452524),
    ("alexnet", (2, 2), (10e9, 1e9), 0.0391418784),
    ("vgg16", (2, 8), (10e9, 1e9), 0.06256844184489795),
    ("resnet50", (4, 4), (10e9, 1.25e9), 0.043208469199999995),
])
def test_hierarchical_dags_match_reference(name, machines, bandwidths, time):
    """Values of the public optimizer (a Python 3 run of it, activation compression ratio 1)."""
    plan = optimize(load(name), Topology(machines, bandwidths))
    assert plan.predicted_time_per_minibatch == pytest.approx(time, rel=1e-9)
    assert plan.workers_used == math.prod(machines)
