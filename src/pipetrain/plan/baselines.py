"""Baseline partitioners: straight pipelines cut by layer count, by parameters, by time.

Each cuts the layers, in topological order, into ``min(workers, layers)`` contiguous stages of one
worker each (every prefix of a topological order is a valid cut of a DAG) and is priced with the
same cost model as PipeDream's optimizer, so the numbers compare directly. On a multi-level
topology a baseline is priced at the slowest level's bandwidth (it does not know the topology).

* ``uniform``: the same number of layers per stage (as near as possible).
* ``parameters``: the contiguous partition minimising the largest stage's parameter bytes.
* ``time``: the contiguous partition minimising the slowest stage's compute time (what
  torchgpipe's ``balance_by_time`` does), communication ignored while choosing.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pipetrain.errors import ConfigError
from pipetrain.plan.cost_model import COST_MODELS, data_parallel_time, stage_time, transfer_in, transfer_out
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.stage_memory import check_schedule
from pipetrain.plan.optimizer import attach_inputs_and_memory
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan, Stage
from pipetrain.plan.topology import Topology

__all__ = ["BASELINES", "baseline", "block_partition", "evaluate_straight"]

BASELINES = ("uniform", "parameters", "time")


def block_partition(weights, parts: int) -> list[int]:
    """Boundaries ``0 = b_0 < ... < b_parts = n`` minimising the largest block sum.

    Exact up to floating point: bisection on the largest sum with a greedy feasibility test, then
    the greedy partition at the bound found (split further to get exactly ``parts`` blocks).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot cut {n} layers into {parts} non-empty stages")

    def greedy(limit: float) -> list[int] | None:
        bounds = [0]
        total = 0.0
        for i, value in enumerate(w):
            if value > limit:
                return None
            if total + value > limit and i > bounds[-1]:
                bounds.append(i)
                total = 0.0
            total += value
        bounds.append(n)
        return bounds if len(bounds) - 1 <= parts else None

    lo, hi = float(w.max(initial=0.0)), float(w.sum())
    best = greedy(hi)
    for _ in range(200):
        if hi - lo <= 1e-15 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    if best is None:
        best = greedy(float(w.sum())) or [0, n]
    # reach exactly `parts` blocks by splitting the widest blocks (never raises the maximum)
    while len(best) - 1 < parts:
        widths = np.diff(best)
        i = int(np.argmax(widths))
        best.insert(i + 1, best[i] + widths[i] // 2)
    return best


def evaluate_straight(cuts: Cuts, bounds: list[int], topology: Topology, method: str,
                      cost_model: str = "pipedream-code", schedule: str = "pipedream",
                      microbatches: int = 1) -> Plan:
    """Price a straight pipeline whose stage ``s`` holds layers ``bounds[s]:bounds[s+1]``."""
    bandwidth = min(topology.bandwidths)
    n = len(cuts.nodes)
    compute = np.concatenate([[0.0], np.cumsum(_layer_values(cuts, "compute"))])
    params = np.concatenate([[0.0], np.cumsum(_layer_values(cuts, "params"))])
    optim = np.concatenate([[0.0], np.cumsum(_layer_values(cuts, "optimizer"))])
    acts = np.concatenate([[0.0], np.cumsum(_layer_values(cuts, "activations"))])
    members = np.arange(n)[None, :] < np.asarray(bounds)[:, None]
    crossing = cuts.output_of(members)          # bytes across each boundary
    stages: list[Stage] = []
    worst_times: list[float] = []
    count = len(bounds) - 1
    for s in range(count):
        lo, hi = bounds[s], bounds[s + 1]
        comp = float(compute[hi] - compute[lo])
        t = float(stage_time(cost_model, comp, float(params[hi] - params[lo]), 1, bandwidth))
        tin = float(transfer_in(cost_model, crossing[s], 1, bandwidth)) if s > 0 else 0.0
        worst = max(t, tin)
        if s > 0:
            worst = max(worst, float(transfer_out(cost_model, crossing[s + 1], 1, bandwidth,
                                                   s == count - 1)))
        stages.append(Stage(layers=[cuts.nodes[i] for i in range(lo, hi)], replicas=1,
                            compute_s=comp, time_s=t,
                            parameter_bytes=float(params[hi] - params[lo]),
                            optimizer_bytes=float(optim[hi] - optim[lo]),
                            activation_bytes=float(acts[hi] - acts[lo]),
                            input_transfer_s=tin, replicas_per_level=(1,),
                            input_bytes=float(crossing[s]) if s > 0 else 0.0,
                            input_bandwidth=bandwidth if s > 0 else 0.0))
        worst_times.append(worst)
    predicted = max(worst_times)
    attach_inputs_and_memory(cuts, stages, schedule, microbatches)
    return Plan(method=method, stages=stages, predicted_time_per_minibatch=predicted,
                workers=topology.workers, schedule=schedule, microbatches=microbatches,
                cost_model=cost_model, topology=topology.describe(),
                single_worker_time=float(compute[-1]),
                data_parallel_time=data_parallel_time(float(compute[-1]), float(params[-1]),
                                                      topology, cost_model))


def _layer_values(cuts: Cuts, what: str) -> np.ndarray:
    layers = {layer.name: layer for layer in cuts.profile.layers}
    getter = {"compute": lambda l: l.compute_s, "params": lambda l: l.parameter_bytes,
              "optimizer": lambda l: l.optimizer_bytes,
              "activations": lambda l: l.activation_bytes}[what]
    return np.array([getter(layers[name]) for name in cuts.nodes], dtype=np.float64)


def baseline(method: str, profile: Profile | Cuts, topology: Topology | int, *,
             cost_model: str = "pipedream-code", schedule: str = "pipedream",
             microbatches: int = 1) -> Plan:
    """Plan with one of :data:`BASELINES` (a straight pipeline over the workers)."""
    if method not in BASELINES:
        raise ConfigError(f"unknown baseline {method!r}; choose one of {', '.join(BASELINES)}")
    if cost_model not in COST_MODELS:
        raise ConfigError(f"unknown cost model {cost_model!r}; choose {' or '.join(COST_MODELS)}")
    schedule = check_schedule(schedule)
    if not isinstance(topology, Topology):
        topology = Topology.flat(int(topology))
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    n = len(cuts.nodes)
    parts = min(topology.workers, n)
    if method == "uniform":
        bounds = [round(i * n / parts) for i in range(parts + 1)]
    elif method == "parameters":
        bounds = block_partition(_layer_values(cuts, "params"), parts)
    else:
        bounds = block_partition(_layer_values(cuts, "compute"), parts)
    plan = evaluate_straight(cuts, bounds, topology, f"balanced-by-{method}" if method != "uniform"
                             else "uniform", cost_model, schedule, microbatches)
    plan.solve_seconds = time.perf_counter() - started
    if not math.isfinite(plan.predicted_time_per_minibatch):
        raise ConfigError("baseline produced no finite plan")
    return plan
