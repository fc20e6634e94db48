"""V schedules: two model chunks per rank placed in a V, the backward split into I and W.

With R ranks the model is cut into 2R stages; rank r holds stage r and stage 2R-1-r, so a
microbatch goes down the ranks and comes back up (R = 3)::

    rank 0: stage 0 ─────────────────────────── stage 5 (loss)
    rank 1:    stage 1 ───────────────── stage 4
    rank 2:       stage 2 ── stage 3            (the turn: a local hand-off, no message)

Rank 0 holds both the first and the last stage, so the loss and the first backward sit where the
microbatch entered: the gradient starts back at once, which is what lets the warm-up shrink.

The orders are :func:`~pipetrain.schedule.greedy.greedy_order`'s at F = I = W under a limit on a
rank's activations (units: a microbatch of one chunk, half a stage of the unchunked model):

=======  =====================  ==============================================================
name     limit (chunk units)    paper
=======  =====================  ==============================================================
zb-v     2R (1f1b's peak)       ZB-V, Qi et al. 2023: makespan 3m + (R-1)/2 at F = I = W = 1
v-half   R + 1 (about 1/2)      V-Half, Qi et al. 2024 ("Pipeline Parallelism with Controllable
v-min    ceil(2R/3) + 1 (~1/3)  Memory"): V-Min, same paper
=======  =====================  ==============================================================

Every step flushes: each rank runs the step's order, then updates both its stages.
"""

from __future__ import annotations

from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.greedy import greedy_order
from pipetrain.schedule.ir import Action, Schedule
from pipetrain.schedule.params import check_positive

__all__ = ["V_SCHEDULES", "v_placement", "v_limit", "v_schedule", "repeat_steps"]

#: The V schedules and their activation limit per rank, in chunk units, for R ranks.
V_SCHEDULES = {
    "zb-v": lambda ranks: 2 * ranks,
    "v-half": lambda ranks: ranks + 1,
    "v-min": lambda ranks: -(-2 * ranks // 3) + 1,
}


def v_placement(ranks: int) -> list[int]:
    """``[rank of stage s]`` for ``2 * ranks`` stages in a V."""
    return [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)]


def v_limit(name: str, ranks: int) -> int:
    """The activation limit of a V schedule, in chunk units (at least 2: one per chunk)."""
    return max(2, V_SCHEDULES[name](ranks))


def repeat_steps(step: Sequence[Sequence[Action]], placement: Sequence[int], microbatches: int,
                 steps: int) -> list[list[Action]]:
    """Programs of ``steps`` flushing steps, each the one-step order ``step`` with its microbatches
    advanced, then the updates of every stage the rank holds."""
    programs: list[list[Action]] = []
    for rank, order in enumerate(step):
        held = [s for s, r in enumerate(placement) if r == rank]
        program: list[Action] = []
        for t in range(steps):
            shift = t * microbatches
            program.extend(a if not shift else a._replace(microbatch=a.microbatch + shift) for a in order)
            for stage in held:
                program.extend(update_actions(stage, False))
        programs.append(program)
    return programs


def v_schedule(name: str, ranks: int, microbatches: int, steps: int = 1,
               replicas: Sequence[int] | None = None) -> Schedule:
    """The V schedule ``name`` (zb-v, v-half, v-min) over ``ranks`` ranks (2 * ranks stages)."""
    check_positive("stages", ranks)
    check_positive("microbatches", microbatches)
    check_positive("steps", steps)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"{name} does not support replicated stages (each rank holds two chunks of a V); use "
                            f"1f1b or pipedream with {option('replicas')}")
    placement = v_placement(ranks)
    stages = len(placement)
    unit = [1.0] * stages
    step = greedy_order(placement, microbatches, unit, unit, unit, [v_limit(name, ranks)] * ranks)
    programs = repeat_steps(step, placement, microbatches, steps)
    return Schedule(programs, [[r] for r in placement], name=name, policy="flush", microbatches=microbatches,
                    steps=steps, chunks=2)
