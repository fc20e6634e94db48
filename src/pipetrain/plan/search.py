"""Choosing the schedule and the microbatch count under a memory limit, scored by simulation.

For every candidate schedule and microbatch count, PipeDream's optimizer partitions the model
under that schedule's memory model (:mod:`pipetrain.plan.stage_memory`); the plan is then turned into a
schedule IR (``pipetrain.schedule.build``) and run through the timeline simulator with the
profile's per-stage forward and backward times, the all-reduce of each replicated stage and the
activation transfers at the bandwidth of the level each cut crosses. The score is the simulated
steady-state time per minibatch (the slope between two run lengths, so warm-up and drain do not
count), bubbles, stalls and all-reduce waits included. Peak memory per worker is re-derived from
the simulated programs (``memory_by_rank``): weight versions and in-flight microbatches actually
held. Candidates that do not fit are dropped; the fastest that fits wins.

The chunked schedules (:data:`~pipetrain.plan.stage_memory.CHUNKED`: interleaved, bfs and interleaved-zb
with 2 chunks per rank, and the V schedules zb-v, v-half, v-min and dualpipev) cut the model into
2W stages for W workers: a balanced block partition of the layers by compute time
(:func:`~pipetrain.plan.baselines.block_partition`), no replicas, each message at the slowest
bandwidth of the topology (on a V, the hand-off at its turn stays on its rank and costs nothing).
The schedule is built over W ranks and simulated with the 2W stages' costs; a worker's peak memory
is the sum over the chunks it holds (:func:`~pipetrain.plan.stage_memory.order_memory`), and every stage
of the plan reports its worker's. zb-h2 is planned like zb-h1 (straight, no replicas).

Modelling choices: a microbatch costs ``1/m`` of the minibatch's forward, backward and activation
bytes; the zero-bubble schedules (:data:`~pipetrain.plan.stage_memory.SPLIT`) split each backward into
equal input- and weight-gradient halves; zb-h1 and zb-h2 run without replication (their generators
have none); the optimizer step costs nothing. With ``recompute`` the
optimizer may let a stage that does not fit recompute its activations (see
:func:`~pipetrain.plan.optimizer.optimize`): the simulation then runs that stage's forward once
more before each backward, and its memory counts the inputs it keeps and the graphs it holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from pipetrain.errors import PipetrainError, ScheduleError, option
from pipetrain.plan.baselines import block_partition, evaluate_straight
from pipetrain.plan.cost_model import data_parallel_time
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.stage_memory import (CHUNKED, SCHEDULES, SPLIT, check_schedule, chunks_of, format_bytes, order_memory,
                                   smallest_fitting)
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan
from pipetrain.plan.topology import Topology
from pipetrain.schedule import Costs, build, memory_by_rank, simulate
from pipetrain.schedule.presets import LOOPED

__all__ = ["search", "simulate_plan", "Simulated", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)


@dataclass
class Simulated:
    """What the timeline simulator says about a plan under its schedule."""

    time_per_minibatch: float
    memory_bytes: list[float]        # peak per stage (worst replica)
    microbatches: int
    bubble_fraction: float


def simulate_plan(plan: Plan, profile: Profile, topology: Topology, calibration: Costs | None = None) -> Simulated:
    """Simulate ``plan`` under ``plan.schedule``; raises ScheduleError if the generator refuses.
    ``calibration`` (``pipetrain calibrate``'s costs) adds what the profile does not hold: the
    runner's overhead per action, each message's sender and receiver busy time and latency, the
    optimizer step per parameter byte (the topology still gives the bandwidths)."""
    layers = {layer.name: layer for layer in profile.layers}
    stages = plan.stages
    count = len(stages)
    m = 1 if plan.schedule == "pipedream" else plan.microbatches
    fwd = [sum(layers[n].forward_s for n in s.layers if n in layers and not layers[n].input)
           for s in stages]
    bwd = [sum(layers[n].backward_s for n in s.layers if n in layers and not layers[n].input)
           for s in stages]
    sync = []
    for stage in stages:
        if stage.replicas <= 1:
            sync.append(0.0)
            continue
        spanned = [i for i, r in enumerate(stage.replicas_per_level) if r > 1]
        bandwidth = topology.bandwidths[max(spanned)] if spanned else min(topology.bandwidths)
        sync.append(4 * (stage.replicas - 1) * stage.parameter_bytes /
                    (bandwidth * stage.replicas))
    # bytes per microbatch across the cut after stage s, at the bandwidth of the level it crosses
    message = [stages[s + 1].input_bytes / m for s in range(count - 1)] + [0.0]
    bandwidth = [stages[s + 1].input_bandwidth if stages[s + 1].input_bandwidth > 0 else math.inf
                 for s in range(count - 1)] + [math.inf]
    split = plan.schedule in SPLIT
    again = [s for s, stage in enumerate(stages) if stage.recompute]
    # a recomputing stage runs its forward once more before its backward (before I when split)
    bwd_first = [(b / (2 if split else 1)) + (f if s in again else 0.0) for s, (f, b) in enumerate(zip(fwd, bwd))]
    costs = Costs(F=[f / m for f in fwd], B=[b / m for b in bwd_first],
                  W=[b / m / 2 for b in bwd] if split else 0.0, sync=sync, bytes=message,
                  bandwidth=bandwidth)
    if calibration is not None:
        costs.charging(calibration)
        costs.step = [calibration.step_per_byte * stage.parameter_bytes for stage in stages]
    if plan.chunks > 1:
        return _simulate_chunked(plan, costs, fwd, bwd)
    replicas = plan.replicas
    if plan.schedule == "pipedream":
        unit = math.lcm(*replicas)
        short = unit * max(1, math.ceil(max(4 * count, 2 * plan.workers_used) / unit))
        runs = [(short, {}), (2 * short, {})]
        per = short
    else:
        runs = [(m, {"steps": 2}), (m, {"steps": 4})]
        per = 2
    spans = []
    schedule = None
    for micro, extra in runs:
        schedule = build(plan.schedule, count, micro, replicas=replicas, **extra)
        spans.append(simulate(schedule, costs).makespan)
    slope = (spans[1] - spans[0]) / per
    busy = sum(f + b for f, b in zip(fwd, bwd)) / max(1, plan.workers_used)
    bubble = max(0.0, 1.0 - busy / slope) if slope > 0 else 0.0
    peaks = [0.0] * count
    for rank_memory in memory_by_rank(schedule, recompute=again):
        for s, held in rank_memory.peak_activations.items():
            versions = rank_memory.peak_versions.get(s, 1)
            stage = stages[s]
            value = versions * stage.parameter_bytes + stage.optimizer_bytes + \
                held * stage.activation_bytes / m + \
                rank_memory.peak_inputs.get(s, 0) * stage.input_bytes / m
            peaks[s] = max(peaks[s], value)
    return Simulated(time_per_minibatch=slope, memory_bytes=peaks, microbatches=m,
                     bubble_fraction=bubble)


def _simulate_chunked(plan: Plan, costs, fwd: list[float], bwd: list[float]) -> Simulated:
    """:func:`simulate_plan` for a plan whose workers hold ``plan.chunks`` stages each."""
    ranks, m = len(plan.stages) // plan.chunks, plan.microbatches
    looped = plan.chunks if plan.schedule in LOOPED else 1
    spans = [simulate(build(plan.schedule, ranks, m, steps=steps, chunks=looped), costs).makespan
             for steps in (2, 4)]
    slope = (spans[1] - spans[0]) / 2
    busy = sum(f + b for f, b in zip(fwd, bwd)) / ranks
    bubble = max(0.0, 1.0 - busy / slope) if slope > 0 else 0.0
    return Simulated(time_per_minibatch=slope, memory_bytes=chunked_memory(plan), microbatches=m,
                     bubble_fraction=bubble)


def chunked_memory(plan: Plan) -> list[float]:
    """Per stage, the peak bytes of the worker that holds it (all its chunks; memory's docstring)."""
    peaks = [0.0] * len(plan.stages)
    m = plan.microbatches
    for stages, held, versions, rank_held in order_memory(plan.schedule, len(plan.stages) // plan.chunks, m):
        kept = [plan.stages[s] for s in stages]
        weights = sum(v * st.parameter_bytes + st.optimizer_bytes for v, st in zip(versions, kept))
        activations = min(sum(h * st.activation_bytes / m for h, st in zip(held, kept)),
                          rank_held * max(st.activation_bytes for st in kept) / m)
        for s in stages:
            peaks[s] = weights + activations
    return peaks


def chunked_plan(cuts: Cuts, topology: Topology, name: str, microbatches: int,
                 cost_model: str = "pipedream-code") -> Plan:
    """``name`` over the topology's W workers: the layers cut into ``chunks * W`` stages balanced
    by compute time, no replicas, each stage's memory its worker's (module docstring)."""
    chunks = chunks_of(name)
    parts = chunks * topology.workers
    if parts > len(cuts.nodes):
        raise PipetrainError(f"{name} cuts the model into {chunks} chunks per worker, {parts} stages, but the "
                             f"profile has {len(cuts.nodes)} layers: use fewer workers")
    layers = {layer.name: layer for layer in cuts.profile.layers}
    bounds = block_partition([layers[n].compute_s for n in cuts.nodes], parts)
    flat = Topology.flat(parts, min(topology.bandwidths))
    plan = evaluate_straight(cuts, bounds, flat, "chunked-by-time", cost_model, "1f1b", microbatches)
    plan.schedule, plan.chunks, plan.workers = name, chunks, topology.workers
    plan.topology = topology.describe()
    ranks = [list(stages) for stages, *_ in order_memory(name, topology.workers, microbatches)]
    plan.predicted_time_per_minibatch = max(sum(plan.stages[s].time_s for s in held) for held in ranks)
    plan.data_parallel_time = data_parallel_time(plan.single_worker_time,
                                                 sum(st.parameter_bytes for st in plan.stages), topology,
                                                 cost_model)
    plan.extra["stages_of_worker"] = ranks  # each stage's memory_bytes: search() sets them from the simulation
    return plan


def search(profile: Profile, topology: Topology, *, memory_limit: float | None = None,
           schedules: Sequence[str] = SCHEDULES,
           microbatches: Sequence[int] | None = None, cost_model: str = "pipedream-code",
           straight: bool = False, fewer_machines: bool = False,
           cuts: Cuts | None = None, recompute: bool = False, calibration: Costs | None = None) -> Plan:
    """The schedule and microbatch count with the least simulated time that fit the memory (of
    equal times, the one with less peak memory); ``recompute``: stages that would not fit may
    recompute their activations (not the chunked schedules, which are cut by time alone);
    ``calibration``: see :func:`simulate_plan`."""
    started = time.perf_counter()
    cuts = cuts or build_cuts(profile)
    names = [check_schedule(name) for name in schedules]
    counts = list(microbatches or DEFAULT_MICROBATCHES)
    tried: list[dict] = []
    planned: set[tuple[str, int]] = set()  # (schedule, microbatches) with a plan in `tried`
    best: tuple[float, Plan, Simulated] | None = None
    for name in names:
        for m in ([1] if name == "pipedream" else counts):
            if (name, m) in planned:
                continue
            unreplicated = name in ("zb-h1", "zb-h2")
            outcome = _chunked_candidate(cuts, profile, topology, name, m, cost_model, calibration) \
                if name in CHUNKED else \
                _candidate(cuts, profile, topology, name, m, memory_limit, cost_model, straight or unreplicated,
                           fewer_machines or unreplicated, planned, recompute, calibration)
            if outcome is None:
                continue                # m was rounded up to a count already tried
            if isinstance(outcome, str):
                tried.append({"schedule": name, "microbatches": m, "error": outcome})
                continue
            plan, sim = outcome
            planned.add((name, plan.microbatches))
            fits = memory_limit is None or max(sim.memory_bytes) <= memory_limit
            tried.append({"schedule": name, "microbatches": plan.microbatches,
                          "replicas": plan.replicas, "chunks": plan.chunks,
                          "predicted_time_per_minibatch": plan.predicted_time_per_minibatch,
                          "simulated_time_per_minibatch": sim.time_per_minibatch,
                          "bubble_fraction": sim.bubble_fraction,
                          "peak_memory_bytes": max(sim.memory_bytes), "fits": fits,
                          "recompute_stages": [s for s, st in enumerate(plan.stages) if st.recompute]})
            if fits and (best is None or _better(sim, best[2])):
                best = (sim.time_per_minibatch, plan, sim)
    if best is None:
        needs = [t["peak_memory_bytes"] for t in tried if "peak_memory_bytes" in t]
        smallest = smallest_fitting([t["error"] for t in tried if "error" in t])
        options = ([smallest[0]] if smallest else []) + needs
        if memory_limit is not None and options:
            raise PipetrainError(
                f"no schedule ({', '.join(names)}) with any microbatch count "
                f"({', '.join(map(str, counts))}) fits in {format_bytes(memory_limit)} per "
                f"worker; the smallest memory limit that fits is {format_bytes(min(options))} "
                f"({min(options):.0f} bytes): raise {option('memory_limit')} to at least that or add workers")
        first = next((t["error"] for t in tried if "error" in t), "no candidate")
        raise PipetrainError(f"no schedule and microbatch count gives a plan: {first}")
    _, plan, sim = best
    for stage, peak in zip(plan.stages, sim.memory_bytes):
        stage.memory_bytes = peak
    plan.extra.update({"simulated_time_per_minibatch": sim.time_per_minibatch,
                       "simulated_bubble_fraction": sim.bubble_fraction,
                       "schedule_candidates": tried, "scored_by": "timeline simulator"})
    plan.solve_seconds = time.perf_counter() - started
    return plan


def _better(sim: Simulated, best: Simulated) -> bool:
    """Faster, or as fast (to a relative 1e-9, the simulator's rounding) with less peak memory."""
    tolerance = 1e-9 * max(abs(best.time_per_minibatch), 1e-300)
    if sim.time_per_minibatch < best.time_per_minibatch - tolerance:
        return True
    return sim.time_per_minibatch <= best.time_per_minibatch + tolerance and \
        max(sim.memory_bytes) < max(best.memory_bytes)


def _chunked_candidate(cuts, profile, topology, name, m, cost_model, calibration=None):
    """A chunked plan and its simulation, or the reason there is none (the generator's refusal)."""
    try:
        plan = chunked_plan(cuts, topology, name, m, cost_model)
        return plan, simulate_plan(plan, profile, topology, calibration)
    except PipetrainError as error:
        return str(error)


def _candidate(cuts, profile, topology, name, m, memory_limit, cost_model, straight, fewer, planned,
               recompute=False, calibration=None):
    """A plan and its simulation, the reason there is none, or None when ``m`` had to be rounded
    up to a count already in ``planned``."""
    plan = None
    for attempt in range(2):
        try:
            plan = optimize(cuts, topology, cost_model=cost_model, straight=straight,
                            fewer_machines=fewer, memory_limit=memory_limit, schedule=name,
                            microbatches=m, recompute=recompute)
            return plan, simulate_plan(plan, profile, topology, calibration)
        except ScheduleError as error:
            # replicas must share the microbatches evenly: round m up once
            unit = math.lcm(*plan.replicas) if plan is not None else 1
            bigger = unit * math.ceil(m / unit)
            if attempt > 0 or plan is None or bigger == m:
                return str(error)
            if (name, bigger) in planned:
                return None
            m = bigger
        except PipetrainError as error:
            return str(error)
    raise AssertionError("unreachable: the second attempt returns")
