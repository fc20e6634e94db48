"""V schedules: two model chunks per rank placed in a V, the backward split into I and W.

With R ranks the model is cut into 2R stages; rank r holds stage r and stage 2R-1-r, so a
microbatch goes down the ranks and comes back up (R = 3)::

    rank 0: stage 0 ─────────────────────────── stage 5 (loss)
    rank 1:    stage 1 ───────────────── stage 4
    rank 2:       stage 2 ── stage 3            (the turn: a local hand-off, no message)

Rank 0 holds both the first and the last stage, so the loss and the first backward sit where the
microbatch entered: the gradient starts back at once, which is what lets the warm-up shrink.

Activations are counted in chunk units (a microbatch of one chunk: half a stage of the unchunked
model, so 1f1b's peak of R stage-microbatches is 2R units):

=======  ============================  =======================================================
name     order                         peak activations (chunk units)
=======  ============================  =======================================================
zb-v     :func:`zb_v_order` (ZB-V,     2R, 1f1b's, held from F until W; at F = I = W = 1 and
         Qi et al. 2023, section 6)    m >= 2R-1 a step takes 3m + (R-1)/2: rank R-1 is busy
                                       from its first forward (at (R-1)/2) to the end
v-half   greedy, limit R + 1           about 1/2 of 1f1b's (V-Half, Qi et al. 2024, "Pipeline
                                       Parallelism with Controllable Memory")
v-min    greedy, limit ceil(2R/3) + 1  about 1/3 of 1f1b's (V-Min, same paper)
=======  ============================  =======================================================

v-half and v-min are :func:`~pipetrain.schedule.greedy.greedy_order`'s at F = I = W under their
limit, counting a microbatch from F to I as :mod:`~pipetrain.schedule.memory` does (the papers'
activation memory); their W run late and keep what W needs until then (the stage input and
output gradient; pipetrain's executor keeps the microbatch's autograd graph).

Every step flushes: each rank runs the step's order, then updates both its stages.
"""

from __future__ import annotations

from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.greedy import greedy_order
from pipetrain.schedule.ir import Action, Kind, Schedule
from pipetrain.schedule.params import check_positive

__all__ = ["V_SCHEDULES", "v_placement", "v_limit", "v_schedule", "zb_v_order", "repeat_steps",
           "check_v_parameters"]

#: The V schedules and their activation limit per rank, in chunk units, for R ranks.
V_SCHEDULES = {
    "zb-v": lambda ranks: 2 * ranks,
    "v-half": lambda ranks: ranks + 1,
    "v-min": lambda ranks: -(-2 * ranks // 3) + 1,
}

_F, _I, _W = Kind.F, Kind.I, Kind.W


def zb_v_order(ranks: int, microbatches: int) -> list[list[Action]]:
    """Per rank, one step of ZB-V: phases of (count, actions), chunk 0 = stage r, chunk 1 = 2R-1-r.

    With ``n = max(m, 2R-1)`` microbatches (those beyond m are left out afterwards), rank r runs::

        2(R-r)-1 x  F0                        warm-up down the V
        r        x  F1 F0                     the first microbatches come back
        R-r      x  F1 I1 W1                  ... and turn into backwards
        n-2R+r+1 x  F0 I0 W0 F1 I1 W1         steady state: both chunks, no idle at F = I = W
        R-r-1    x     I0 W0 F1 I1 W1         (chunk 0 has no forwards left)
        r        x  I0 I1                     cool-down: input gradients first,
        R-r      x  I0 W0
        r        x  W1,  then r x W0          the deferred weight gradients last

    Each action takes the next microbatch of its (chunk, kind): forwards, input gradients and
    weight gradients run in microbatch order within a chunk.
    """
    padded = max(microbatches, 2 * ranks - 1)
    programs = []
    for r in range(ranks):
        stage = (r, 2 * ranks - 1 - r)
        phases = [
            (2 * (ranks - r) - 1, ((_F, 0),)),
            (r, ((_F, 1), (_F, 0))),
            (ranks - r, ((_F, 1), (_I, 1), (_W, 1))),
            (padded - 2 * ranks + r + 1, ((_F, 0), (_I, 0), (_W, 0), (_F, 1), (_I, 1), (_W, 1))),
            (ranks - r - 1, ((_I, 0), (_W, 0), (_F, 1), (_I, 1), (_W, 1))),
            (r, ((_I, 0), (_I, 1))),
            (ranks - r, ((_I, 0), (_W, 0))),
            (r, ((_W, 1),)),
            (r, ((_W, 0),)),
        ]
        taken = {(kind, chunk): 0 for kind in (_F, _I, _W) for chunk in (0, 1)}
        program = []
        for count, actions in phases:
            for _ in range(count):
                for kind, chunk in actions:
                    k = taken[(kind, chunk)]
                    taken[(kind, chunk)] = k + 1
                    if k < microbatches:
                        program.append(Action(kind, stage[chunk], k))
        programs.append(program)
    return programs


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


def check_v_parameters(name: str, ranks: int, microbatches: int, replicas: Sequence[int] | None = None) -> None:
    """Refuse what no V schedule can run: replicated stages, fewer than 2R-1 microbatches a step."""
    check_positive("stages", ranks)
    check_positive("microbatches", microbatches)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"{name} does not support replicated stages (each rank holds two chunks of a V); use "
                            f"1f1b or pipedream with {option('replicas')}")
    if microbatches < 2 * ranks - 1:
        raise ScheduleError(
            f"{name} over {ranks} ranks needs at least {2 * ranks - 1} microbatches per step (2R-1) to fill its V, "
            f"got {microbatches}: use {option('microbatches', 2 * ranks - 1)} or more, fewer {option('stages')} "
            f"(ranks), or zb-h1")


def v_schedule(name: str, ranks: int, microbatches: int, steps: int = 1,
               replicas: Sequence[int] | None = None) -> Schedule:
    """The V schedule ``name`` (zb-v, v-half, v-min) over ``ranks`` ranks (2 * ranks stages)."""
    check_positive("steps", steps)
    check_v_parameters(name, ranks, microbatches, replicas)
    placement = v_placement(ranks)
    stages = len(placement)
    if name == "zb-v":
        step = zb_v_order(ranks, microbatches)
    else:
        unit = [1.0] * stages
        step = greedy_order(placement, microbatches, unit, unit, unit, [v_limit(name, ranks)] * ranks,
                            until_w=False)
    programs = repeat_steps(step, placement, microbatches, steps)
    return Schedule(programs, [[r] for r in placement], name=name, policy="flush", microbatches=microbatches,
                    steps=steps, chunks=2)
