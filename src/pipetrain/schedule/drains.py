"""A schedule that drains its pipeline after chosen updates and fills it again: how a finished
asynchronous run is continued for more updates (``pipetrain train --extend``).

An asynchronous schedule (pipedream, 2bw, pb) never flushes, except at its end: a run of 9
updates drains there, and the run of 18 updates has microbatches in flight at update 9 instead.
So the first run's last checkpoint is not a point of the longer run, and the longer run cannot
continue from it. What it can continue is the first run followed by a second one: the schedule of
9 updates, then the schedule of 9 more, its microbatches and weight versions numbered on::

    rank 0:  0F0@v0 ... 0B8@v7 0STEP | 0F9@v9 ... (the 9-update schedule again, shifted)
                                     ^ drained: nothing in flight, no message crossing

The cut after update 9 of this schedule is the end of the first run's programs, exactly what its
last checkpoint holds; the result is the first run extended, not the uninterrupted longer run.
For a synchronous schedule the pieces joined are the longer schedule itself.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pipetrain.schedule.ir import Action, Kind, Schedule

__all__ = ["drained"]


def drained(make: Callable[[int], Schedule], updates: int, drains: Sequence[int], units: int,
            asynchronous: bool) -> Schedule:
    """The schedule of ``updates`` updates that drains after each update count of ``drains``:
    ``make(n)`` (the schedule of ``n`` updates, ``units`` microbatches each) for every piece
    between two drains, each shifted past the pieces before it (microbatches by their units,
    each stage's weight versions by the updates it made). ``asynchronous``: whether ``make``
    counts the units of the whole run in ``microbatches`` (pipedream, pb) or per step."""
    bounds = [0, *sorted({d for d in drains if 0 < d < updates}), updates]
    programs: list[list[Action]] | None = None
    made: dict[int, int] = {}  # stage -> weight versions made by the pieces so far
    first = None
    for start, end in zip(bounds, bounds[1:]):
        piece = make(end - start)
        first = first or piece
        if programs is None:
            programs = [[] for _ in piece.programs]
        shift = start * units
        steps: dict[int, int] = {}
        for rank, program in enumerate(piece.programs):
            out = programs[rank]
            for action in program:
                kind, stage, k, version, peer = action
                if kind is Kind.STEP and rank == piece.stage_ranks[stage][0]:
                    steps[stage] = steps.get(stage, 0) + 1
                if start:
                    if kind is Kind.FB:  # a pair: its backward half moves too
                        half = peer
                        peer = Action(half.kind, half.stage, half.microbatch + shift,
                                      None if half.version is None else half.version + made.get(half.stage, 0))
                    action = Action(kind, stage, None if k is None else k + shift,
                                    None if version is None else version + made.get(stage, 0), peer)
                out.append(action)
        for stage, count in steps.items():
            made[stage] = made.get(stage, 0) + count
    assert first is not None and programs is not None
    return Schedule(
        programs=programs, stage_ranks=[list(r) for r in first.stage_ranks], name=first.name, policy=first.policy,
        microbatches=updates * units if asynchronous else first.microbatches, steps=1 if asynchronous else updates,
        chunks=first.chunks, meta=dict(first.meta),
    )
