"""Interleaved 1F1B (Megatron-LM virtual pipeline stages).

Each of the P ranks holds v model chunks: chunk c of rank r is virtual stage ``c * P + r``, so a
microbatch visits every rank v times and the pipeline bubble shrinks by v. Forwards go in groups
of P microbatches per chunk; with P = 2, v = 2, m = 4 rank 0 runs the forward units::

    unit:   0    1    2    3    4    5    6    7
    chunk:  0    0    1    1    0    0    1    1
    mb:     0    1    0    1    2    3    2    3

and the backward units in the same grouping with chunks reversed. Rank r runs
``2(P-r-1) + (v-1)P`` warm-up forwards before alternating. The grouping needs m to be a multiple
of P. With v = 1 this is exactly 1f1b.
"""

from __future__ import annotations

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import one_f_one_b, update_actions
from pipetrain.schedule.ir import Action, Kind, Schedule
from pipetrain.schedule.params import check_positive

__all__ = ["interleaved"]


def interleaved(stages: int, microbatches: int, steps: int = 1, chunks: int = 2, replicas=None) -> Schedule:
    """Interleaved 1F1B over ``stages`` ranks with ``chunks`` model chunks each (S*v virtual stages)."""
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("steps", steps)
    check_positive("chunks", chunks)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(
            f"interleaved does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    if chunks == 1:
        schedule = one_f_one_b(stages, microbatches, steps)
        schedule.name = "interleaved"
        return schedule
    ranks = stages
    if microbatches % ranks:
        lower = (microbatches // ranks) * ranks
        fixes = [option("microbatches", v) for v in (lower, lower + ranks) if v > 0]
        raise ScheduleError(
            f"interleaved runs microbatches in groups of one per rank, so {option('microbatches')} must be a "
            f"multiple of {option('stages')} ({ranks}); got {microbatches}: use {' or '.join(fixes)}"
        )
    total = microbatches * chunks
    new = tuple.__new__
    F, B = Kind.F, Kind.B
    group_size = ranks * chunks
    # unit k of a step: chunk (k // P) % v (reversed for backwards), microbatch (k // (P v)) P + k % P
    unit_chunk = [(k % group_size) // ranks for k in range(total)]
    unit_offset = [(k // group_size) * ranks + k % ranks for k in range(total)]
    programs: list[list[Action]] = []
    for rank in range(ranks):
        program: list[Action] = []
        append = program.append
        warm = min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)
        forward_stage = [unit_chunk[k] * ranks + rank for k in range(total)]
        backward_stage = [(chunks - 1 - unit_chunk[k]) * ranks + rank for k in range(total)]
        for step in range(steps):
            base = step * microbatches
            forwards = [new(Action, (F, forward_stage[k], base + unit_offset[k], None, None)) for k in range(total)]
            backwards = [new(Action, (B, backward_stage[k], base + unit_offset[k], None, None)) for k in range(total)]
            program.extend(forwards[:warm])
            for k in range(total - warm):
                append(forwards[warm + k])
                append(backwards[k])
            program.extend(backwards[total - warm:])
            for chunk in range(chunks):
                program.extend(update_actions(chunk * ranks + rank, False))
        programs.append(program)
    placement = [[stage % ranks] for stage in range(ranks * chunks)]
    return Schedule(
        programs, placement, name="interleaved", policy="flush", microbatches=microbatches, steps=steps, chunks=chunks
    )
