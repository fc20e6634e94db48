"""Interleaved zero bubble, ZB1P (Qi et al., 2024; torch's ScheduleInterleavedZeroBubble).

Interleaved 1F1B's placement and chunk rotation (chunk c of rank r is stage ``c * P + r``) with the
backward split into I and W, as zb-h1 splits 1F1B's. Microbatches go in rounds of
``m / max(1, m // P)``; rank r runs ``(v - 1) * round + (P - 1 - r)`` warm-up forwards (interleaved
runs twice the ``P - 1 - r``), then a forward and an input gradient (I) per step, and from its
``r + 1``-th I on a deferred W after each: the W of rank r lag r backwards, filling the bubbles the
returning gradients leave. With P = 2, v = 2, m = 4::

    rank 0:  0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 ...
    rank 1:  1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 ...
"""

from __future__ import annotations

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.ir import Action, Kind, Schedule
from pipetrain.schedule.params import check_positive

__all__ = ["interleaved_zero_bubble", "rounds"]


def rounds(ranks: int, microbatches: int, name: str) -> int:
    """Microbatches per round: ``m / max(1, m // P)``, which must divide ``m`` (torch's rule)."""
    count = max(1, microbatches // ranks)
    if microbatches % count:
        fixes = sorted({v for v in (count * (microbatches // count), count * (microbatches // count + 1)) if v > 0})
        raise ScheduleError(
            f"{name} runs microbatches in {count} equal rounds ({option('microbatches')} // {option('stages')}), "
            f"so {option('microbatches')} must be a multiple of {count}; got {microbatches}: use "
            + " or ".join(option("microbatches", v) for v in fixes))
    return microbatches // count


def _rank_order(rank: int, ranks: int, chunks: int, microbatches: int, base: int) -> list[Action]:
    """One step of rank ``rank``: warm-up forwards, then F, I and (lagged) W, then the rest."""
    per_round = rounds(ranks, microbatches, "interleaved-zb")
    total = chunks * microbatches
    warm = min((chunks - 1) * per_round + (ranks - 1 - rank), total)

    def forward_stage(unit: int) -> int:
        return ((unit // per_round) % chunks) * ranks + rank

    def backward_stage(unit: int) -> int:
        return (chunks - 1 - ((unit - warm) // per_round) % chunks) * ranks + rank

    counts = {Kind.F: {}, Kind.I: {}, Kind.W: {}}
    program: list[Action] = []

    def add(kind: Kind, stage: int) -> None:
        seen = counts[kind]
        k = seen.get(stage, 0)
        seen[stage] = k + 1
        program.append(Action(kind, stage, base + k))

    backwards: list[int] = []  # the stage of each I so far, in order: their W follow in that order
    weights = 0
    for unit in range(total + warm):
        if unit < total:
            add(Kind.F, forward_stage(unit))
        if unit >= warm:
            backwards.append(backward_stage(unit))
            add(Kind.I, backwards[-1])
            if unit - warm >= rank:
                add(Kind.W, backwards[weights])
                weights += 1
    for stage in backwards[weights:]:
        add(Kind.W, stage)
    return program


def interleaved_zero_bubble(stages: int, microbatches: int, steps: int = 1, chunks: int = 2,
                            replicas=None) -> Schedule:
    """ZB1P over ``stages`` ranks with ``chunks`` model chunks each (``stages * chunks`` stages)."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps), ("chunks", chunks)):
        check_positive(name, value)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(
            f"interleaved-zb does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    rounds(stages, microbatches, "interleaved-zb")
    programs = []
    for rank in range(stages):
        program: list[Action] = []
        for step in range(steps):
            program.extend(_rank_order(rank, stages, chunks, microbatches, step * microbatches))
            for chunk in range(chunks):
                program.extend(update_actions(chunk * stages + rank, False))
        programs.append(program)
    placement = [[stage % stages] for stage in range(stages * chunks)]
    return Schedule(programs, placement, name="interleaved-zb", policy="flush", microbatches=microbatches,
                    steps=steps, chunks=chunks)
