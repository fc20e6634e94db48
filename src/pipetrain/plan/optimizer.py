"""PipeDream's partitioning optimizer: stages, replication, a hierarchical topology.

Dynamic programming over (cut, cut, machines), level by level (Narayanan et al., SOSP 2019,
section 3.1; docs/design.md 3.6). At level ``l`` with ``n`` components joined by bandwidth ``B``::

    A(r -> j, M) = min( T(r -> j, M),                                   # one stage, M replicas
                        min over cuts k, m' < M of
                            max(A(r -> k, M - m'), T(k -> j, m'), in(k, m'), out(j, m')) )

where ``T`` prices one stage. The level's "compute" of a range is the compute time at level 1 and
the previous level's best pipeline ``A_{l-1}(r -> j, n_{l-1})`` above, so every level but the last
solves all ranges; the last solves only the whole model. Two cost models:

``pipedream-code`` (the public optimizer, ``optimizer_graph_hierarchical.py``)
    ``T = (compute + 4 (m-1)/m * params / B) / m``, all-reduce added to compute; a one-stage
    pipeline's all-reduce is further divided by the previous level's size, as in that code.
    ``in(k, m') = 2 out_k / (B m')``; ``out(j, m') = 2 out_j / (B m')`` unless ``j`` is the end.
``paper``
    ``T = max(compute, 4 (m-1)/m * params / B) / m`` (compute and all-reduce overlap),
    ``in(k) = 2 out_k / B``, no ``out`` term.

Options: ``straight`` (no replication), ``fewer_machines`` (a plan may leave workers idle: with it,
more workers never give a worse plan), and a memory limit per worker for a single-level topology
(see :mod:`pipetrain.plan.stage_memory`; stage ``s`` of PipeDream holds ``ceil(workers from s / r_s)``
weight versions and minibatches of activations). Under a memory limit, ``recompute`` lets a stage
that does not fit keep only its inputs and run its forward again in its backward: priced ``T`` of
``compute + forward`` instead of ``compute`` (the forward once more per minibatch), and chosen
only where the stage would not fit otherwise, so a stage's cost is the cheaper of the options
that fit. Each option's cost falls with more replicas and fewer workers after the stage, so their
minimum does too, which is all the sweep below needs.

Deviation from the public code, on purpose: with ``fewer_machines`` a one-layer range may also use
fewer replicas, and for DAG models the ranges of inner levels are only ever between nested cuts
(the public code also subtracts unrelated ones).

The tables are the recurrence's, filled so that thousands of workers take seconds (docs/planner.md,
"How it stays fast"): one machine count at a time with a crossing pointer per (row, k, j) instead
of a min over every ``m'`` (:mod:`pipetrain.plan.sweep`); large last levels only inside the
machine counts a plan within a bisected time can use (:mod:`pipetrain.plan.window`); several levels
in a band of the stages such a plan can have (:meth:`pipetrain.plan.solver.Solver._band`); idle workers under a memory
limit by one DP built from the end of the model (:class:`pipetrain.plan.mirror.Mirror`). Each table's cost is
estimated first: long ones show progress, ones that would not finish are refused
(:mod:`pipetrain.plan.effort`).
"""


from __future__ import annotations

import math
import time

import numpy as np

from pipetrain.errors import ConfigError, PipetrainError, name_options, option
from pipetrain.plan.cost_model import COST_MODELS, data_parallel_time, stage_time, transfer_in
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.level import MemoryBudget
from pipetrain.plan.stage_memory import CHUNKED, RECOMPUTES, check_schedule, format_bytes, stage_memory
from pipetrain.plan.mirror import Mirror
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan, Stage
from pipetrain.plan.solver import Solver
from pipetrain.plan.topology import Topology

__all__ = ["optimize", "attach_inputs_and_memory"]

name_options({"memory_limit": "--memory"}, {})  # optimize(memory_limit=): `pipetrain plan --memory BYTES`


def optimize(profile: Profile | Cuts, topology: Topology | int, *,
             cost_model: str = "pipedream-code", straight: bool = False,
             fewer_machines: bool = False, memory_limit: float | None = None,
             schedule: str = "pipedream", microbatches: int = 1,
             progress: bool = False, recompute: bool = False) -> Plan:
    """Partition ``profile`` over ``topology`` with PipeDream's optimizer.

    ``topology`` is a :class:`Topology` or a worker count (one level at 1e9 B/s). Returns a
    :class:`Plan` whose ``predicted_time_per_minibatch`` is the slowest stage's time.
    ``recompute``: under ``memory_limit`` on a one-level topology, a stage that would not fit
    may recompute its activations (:data:`~pipetrain.plan.stage_memory.RECOMPUTES` schedules), paying
    its forward once more per minibatch; the plan's stages say which do.
    ``progress``: show the progress of tables that take more than a few seconds (a bar on a
    terminal, one line on stderr otherwise). A size that would not finish here is refused with
    the largest that would (:mod:`pipetrain.plan.effort`).
    """
    if cost_model not in COST_MODELS:
        raise ConfigError(f"unknown cost model {cost_model!r}; choose {' or '.join(COST_MODELS)}")
    schedule = check_schedule(schedule)
    if schedule in CHUNKED:
        raise ConfigError(f"{schedule} holds several stages per rank: PipeDream's optimizer plans one stage per "
                          f"worker; plan it with make_plan or {option('schedule', 'auto')}")
    if int(microbatches) != microbatches or microbatches < 1:
        raise ConfigError(f"microbatches must be an integer >= 1, got {microbatches}")
    if not isinstance(topology, Topology):
        topology = Topology.flat(int(topology))
    recompute = (bool(recompute) and memory_limit is not None and schedule in RECOMPUTES
                 and topology.levels == 1)
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    if memory_limit is not None and fewer_machines and topology.levels == 1:
        # idle workers change every stage's in-flight count: the best plan on exactly n workers
        # for every n at once (built from the end), then the fastest n solved as usual
        memory = MemoryBudget(memory_limit, schedule, int(microbatches), topology.workers, recompute)
        mirror = Mirror(cuts, topology, cost_model, straight, memory)
        mirror.progress = progress
        times = mirror.best()
        pick = int(np.argmin(times))
        flat = Topology.flat(pick + 1, topology.bandwidths[0])
        solver = Solver(cuts, flat, cost_model, straight, False,
                         MemoryBudget(memory_limit, schedule, int(microbatches), pick + 1, recompute))
        solver.progress = progress
        best = solver.solve() if math.isfinite(times[pick]) else math.inf
        if not math.isfinite(best):
            smallest = float(np.min(mirror.best(mode="memory")))
            _explain_infeasible(solver, cuts, topology, straight, True, memory_limit, schedule,
                                smallest, recompute)
    else:
        memory = MemoryBudget(memory_limit, schedule, int(microbatches), topology.workers, recompute)
        solver = Solver(cuts, topology, cost_model, straight, fewer_machines, memory)
        solver.progress = progress
        best = solver.solve()
        if not math.isfinite(best):
            _explain_infeasible(solver, cuts, topology, straight, fewer_machines, memory_limit,
                                schedule, recompute=recompute)
    flat = solver.stages()
    solve_seconds = time.perf_counter() - started
    stages = _describe(solver, flat)
    if memory_limit is not None and topology.levels > 1:
        worst = max(stage.memory_bytes or 0.0 for stage in stages)
        if worst > memory_limit:
            raise PipetrainError(
                f"the best plan over topology {topology.describe()} needs {format_bytes(worst)} "
                f"per worker, more than the limit {format_bytes(memory_limit)}; memory-constrained "
                f"planning is exact for one-level topologies only: plan with a flat {option('bandwidth')}, "
                f"or raise {option('memory_limit')}")
    total_params = float(cuts.params[-1])
    return Plan(method="pipedream", stages=stages, predicted_time_per_minibatch=best,
                workers=topology.workers, schedule=schedule, microbatches=int(microbatches),
                cost_model=cost_model, topology=topology.describe(),
                single_worker_time=float(cuts.compute[-1]),
                data_parallel_time=data_parallel_time(float(cuts.compute[-1]), total_params,
                                                      topology, cost_model),
                solve_seconds=solve_seconds, memory_limit=memory_limit,
                extra={"straight": straight, "fewer_machines": fewer_machines,
                       **({"recompute": "auto"} if recompute else {})})


def _explain_infeasible(solver: Solver, cuts: Cuts, topology: Topology, straight: bool,
                        fewer: bool, memory_limit: float | None, schedule: str,
                        smallest: float | None = None, recompute: bool = False) -> None:
    layers = cuts.num_states - 1
    if memory_limit is not None and topology.levels == 1:
        if smallest is None:
            smallest = solver.smallest_memory()
        if math.isfinite(smallest):
            also = f", or let stages recompute their activations ({option('recompute', True, cli='auto')})" if (
                not recompute and schedule in RECOMPUTES) else ""
            raise PipetrainError(
                f"no plan over {topology.workers} workers fits in {format_bytes(memory_limit)} "
                f"per worker with schedule {schedule}"
                + (" with recomputation" if recompute else "") + "; the smallest memory limit that fits is "
                f"{format_bytes(smallest)} ({smallest:.0f} bytes): raise {option('memory_limit')} to at least "
                f"that, add workers, or pick a schedule that stashes less (2bw, 1f1b){also}")
    if straight and not fewer and topology.workers > layers:
        raise PipetrainError(
            f"a straight pipeline over {topology.workers} workers needs at least "
            f"{topology.workers} cut points, but the model has only {layers}: use fewer workers, "
            f"allow idle workers ({option('fewer_machines')}), or allow replication (drop {option('straight')})")
    raise PipetrainError(f"no plan fits {topology.describe()} with these options; "
                         f"try allowing idle workers ({option('fewer_machines')})")


def _describe(solver: Solver, flat: list) -> list[Stage]:
    cuts = solver.cuts
    topology = solver.topology
    model = solver.model
    memory = solver.memory
    stages: list[Stage] = []
    replicas_of = [math.prod(m for m, *_ in path) for _, _, path in flat]
    used, before = sum(replicas_of), 0
    for (a, b, path), count in zip(flat, replicas_of):
        compute = float(cuts.compute[b] - cuts.compute[a])
        # recomputes where the stage does not fit as it is (the choice the DP made: its memory
        # depends on the workers from it to the end only)
        again = memory.recompute and memory.limit is not None and float(stage_memory(
            memory.schedule, parameter_bytes=cuts.params[b] - cuts.params[a],
            optimizer_bytes=cuts.optimizer[b] - cuts.optimizer[a],
            activation_bytes=cuts.activations[b] - cuts.activations[a], workers_from_here=used - before,
            replicas=count, microbatches=memory.microbatches)) > memory.limit
        before += count
        extra = float(cuts.forward[b] - cuts.forward[a]) if again and cuts.forward is not None else 0.0
        t = compute + extra
        replicas = 1
        for index, (m, kind, start, end) in enumerate(path):
            bandwidth = topology.bandwidths[index]
            within = topology.machines[index - 1] if index > 0 else 1
            pseg = float(cuts.params[end] - cuts.params[start])
            t = float(stage_time(model, t, pseg, m, bandwidth, within, single=kind == "single"))
            replicas *= m
        tin = bandwidth_in = 0.0
        if a > 0:
            for index, (m, kind, start, _) in enumerate(path):
                if kind == "split" and start == a:
                    bandwidth_in = topology.bandwidths[index]
                    tin = float(transfer_in(model, cuts.output[a], m, bandwidth_in))
                    break
        layers = cuts.stage_layers(a, b)
        stages.append(Stage(layers=layers, replicas=replicas, compute_s=compute, time_s=t,
                            parameter_bytes=float(cuts.params[b] - cuts.params[a]),
                            optimizer_bytes=float(cuts.optimizer[b] - cuts.optimizer[a]),
                            activation_bytes=float(cuts.activations[b] - cuts.activations[a]),
                            input_transfer_s=tin, input_bytes=float(cuts.output[a]),
                            input_bandwidth=bandwidth_in,
                            replicas_per_level=tuple(m for m, *_ in path), recompute=bool(again),
                            recompute_s=extra))
    attach_inputs_and_memory(cuts, stages, solver.memory.schedule, solver.memory.microbatches)
    return stages


def attach_inputs_and_memory(cuts: Cuts, stages: list[Stage], schedule: str,
                             microbatches: int) -> None:
    """Put input layers in stage 0 and dropped output sinks with their producer; fill memory
    (with recomputation on the stages that recompute)."""
    stages[0].layers = list(cuts.inputs) + stages[0].layers
    where = {name: s for s, stage in enumerate(stages) for name in stage.layers}
    for tail, producers in cuts.tails.items():
        s = max((where[p] for p in producers if p in where), default=len(stages) - 1)
        stages[s].layers.append(tail)
    used = sum(stage.replicas for stage in stages)
    before = 0
    for stage in stages:
        stage.memory_bytes = float(stage_memory(
            schedule, parameter_bytes=stage.parameter_bytes,
            optimizer_bytes=stage.optimizer_bytes, activation_bytes=stage.activation_bytes,
            workers_from_here=used - before, replicas=stage.replicas,
            microbatches=microbatches, recompute=stage.recompute, input_bytes=stage.input_bytes))
        before += stage.replicas
