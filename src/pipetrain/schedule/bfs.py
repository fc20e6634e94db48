"""Looped breadth-first pipelining (Lamy-Poirier, 2022; torch's ScheduleLoopedBFS).

Placement as interleaved: of P ranks with v chunks each, chunk c of rank r is stage ``c * P + r``.
Where interleaved goes depth first (a few microbatches through every chunk), BFS goes breadth
first: a rank runs the forwards of all microbatches on its first chunk, then on its next, and the
backwards chunk by chunk from its last, newest microbatch first. With P = 2, v = 2, m = 3::

    rank 0:  0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0 STEP STEP
    rank 1:  1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0 STEP STEP

Every stage holds all m microbatches at its peak (as GPipe) and sums its gradients from the last
microbatch to the first.
"""

from __future__ import annotations

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.ir import Action, Kind, Schedule
from pipetrain.schedule.params import check_positive

__all__ = ["looped_bfs"]


def looped_bfs(stages: int, microbatches: int, steps: int = 1, chunks: int = 2, replicas=None) -> Schedule:
    """Looped BFS over ``stages`` ranks with ``chunks`` model chunks each (``stages * chunks`` stages)."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps), ("chunks", chunks)):
        check_positive(name, value)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"bfs does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    ranks = stages
    programs: list[list[Action]] = []
    for rank in range(ranks):
        held = [chunk * ranks + rank for chunk in range(chunks)]
        program: list[Action] = []
        for step in range(steps):
            units = range(step * microbatches, (step + 1) * microbatches)
            for stage in held:
                program.extend(Action(Kind.F, stage, k) for k in units)
            for stage in reversed(held):
                program.extend(Action(Kind.B, stage, k) for k in reversed(units))
            for stage in held:
                program.extend(update_actions(stage, False))
        programs.append(program)
    placement = [[stage % ranks] for stage in range(ranks * chunks)]
    return Schedule(programs, placement, name="bfs", policy="flush", microbatches=microbatches, steps=steps,
                    chunks=chunks)
