"""Choosing the schedule and the microbatch count under a memory limit, scored by simulation.

For every candidate schedule and microbatch count, PipeDream's optimizer partitions the model
under that schedule's memory model (:mod:`pipetrain.plan.memory`); the plan is then turned into a
schedule IR (``pipetrain.schedule.build``) and run through the timeline simulator with the
profile's per-stage forward and backward times, the all-reduce of each replicated stage and the
activation transfers at the bandwidth of the level each cut crosses. The score is the simulated
steady-state time per minibatch (the slope between two run lengths, so warm-up and drain do not
count), bubbles, stalls and all-reduce waits included. Peak memory per worker is re-derived from
the simulated programs (``memory_by_rank``): weight versions and in-flight microbatches actually
held. Candidates that do not fit are dropped; the fastest that fits wins.

Modelling choices: a microbatch costs ``1/m`` of the minibatch's forward, backward and activation
bytes; zb-h1 splits each backward into equal input- and weight-gradient halves and runs without
replication (the generator has none); the optimizer step costs nothing. With ``recompute`` the
optimizer may let a stage that does not fit recompute its activations (see
:func:`~pipetrain.plan.pipedream.optimize`): the simulation then runs that stage's forward once
more before each backward, and its memory counts the inputs it keeps and the graphs it holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from pipetrain.errors import PipetrainError, ScheduleError, option
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.memory import SCHEDULES, check_schedule, format_bytes
from pipetrain.plan.pipedream import optimize
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan
from pipetrain.plan.topology import Topology

__all__ = ["search", "simulate_plan", "Simulated", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)


@dataclass
class Simulated:
    """What the timeline simulator says about a plan under its schedule."""

    time_per_minibatch: float
    memory_bytes: list[float]        # peak per stage (worst replica)
    microbatches: int
    bubble_fraction: float


def simulate_plan(plan: Plan, profile: Profile, topology: Topology) -> Simulated:
    """Simulate ``plan`` under ``plan.schedule``; raises ScheduleError if the generator refuses."""
    from pipetrain.schedule import Costs, build, memory_by_rank, simulate

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
    # seconds in flight per microbatch across the cut after stage s
    transfer = [stages[s + 1].input_bytes / stages[s + 1].input_bandwidth / m
                if stages[s + 1].input_bandwidth > 0 else 0.0 for s in range(count - 1)] + [0.0]
    split = plan.schedule == "zb-h1"
    again = [s for s, stage in enumerate(stages) if stage.recompute]
    # a recomputing stage runs its forward once more before its backward (before I when split)
    bwd_first = [(b / (2 if split else 1)) + (f if s in again else 0.0) for s, (f, b) in enumerate(zip(fwd, bwd))]
    costs = Costs(F=[f / m for f in fwd], B=[b / m for b in bwd_first],
                  W=[b / m / 2 for b in bwd] if split else 0.0, sync=sync, bytes=transfer,
                  bandwidth=1.0)
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


def search(profile: Profile, topology: Topology, *, memory_limit: float | None = None,
           schedules: Sequence[str] = SCHEDULES,
           microbatches: Sequence[int] | None = None, cost_model: str = "pipedream-code",
           straight: bool = False, fewer_machines: bool = False,
           cuts: Cuts | None = None, recompute: bool = False) -> Plan:
    """The schedule and microbatch count with the least simulated time that fit the memory;
    ``recompute``: stages that would not fit may recompute their activations."""
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
            outcome = _candidate(cuts, profile, topology, name, m, memory_limit, cost_model,
                                 straight or name == "zb-h1", fewer_machines or name == "zb-h1", planned,
                                 recompute)
            if outcome is None:
                continue                # m was rounded up to a count already tried
            if isinstance(outcome, str):
                tried.append({"schedule": name, "microbatches": m, "error": outcome})
                continue
            plan, sim = outcome
            planned.add((name, plan.microbatches))
            fits = memory_limit is None or max(sim.memory_bytes) <= memory_limit
            tried.append({"schedule": name, "microbatches": plan.microbatches,
                          "replicas": plan.replicas,
                          "predicted_time_per_minibatch": plan.predicted_time_per_minibatch,
                          "simulated_time_per_minibatch": sim.time_per_minibatch,
                          "bubble_fraction": sim.bubble_fraction,
                          "peak_memory_bytes": max(sim.memory_bytes), "fits": fits,
                          "recompute_stages": [s for s, st in enumerate(plan.stages) if st.recompute]})
            if fits and (best is None or sim.time_per_minibatch < best[0]):
                best = (sim.time_per_minibatch, plan, sim)
    if best is None:
        from pipetrain.plan.planner import smallest_fitting

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


def _candidate(cuts, profile, topology, name, m, memory_limit, cost_model, straight, fewer, planned,
               recompute=False):
    """A plan and its simulation, the reason there is none, or None when ``m`` had to be rounded
    up to a count already in ``planned``."""
    plan = None
    for attempt in range(2):
        try:
            plan = optimize(cuts, topology, cost_model=cost_model, straight=straight,
                            fewer_machines=fewer, memory_limit=memory_limit, schedule=name,
                            microbatches=m, recompute=recompute)
            return plan, simulate_plan(plan, profile, topology)
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
