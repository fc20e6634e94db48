"""The compute order of one stage replica: warm-up forwards, then one forward / one backward.

Every schedule family except interleaved is this one pattern with different parameters::

    warm-up = 3, 6 microbatches, no split:   F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
    warm-up = 6 (GPipe: all forwards first): F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5
    warm-up = 1, split, W lag 1:             F0 F1 I0 F2 I1 W0 F3 I2 W1 ... I5 W4 W5

The warm-up depth is what distinguishes 1F1B (``S-1-s``), PipeDream (NOAM), PB (``2(S-1-s)``)
and GPipe (everything). Updates (``STEP``, preceded by ``SYNC`` on replicated stages) are placed by
a callback so that synchronous and asynchronous schedules share the order.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pipetrain.schedule.ir import Action, Kind

__all__ = ["one_forward_one_backward", "warmup_depths", "stage_placement"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


def one_forward_one_backward(
    stage: int,
    microbatches: Sequence[int],
    warmup: int,
    *,
    split_backward: bool = False,
    w_lag: int = 0,
    after_backward: Callable[[int, int], Sequence[Action]] | None = None,
) -> list[Action]:
    """Compute actions of one replica of ``stage`` for ``microbatches`` (in order).

    ``warmup`` forwards run first; then each further forward is followed by the backward of the
    oldest microbatch in flight. With ``split_backward`` the backward is an ``I`` (input gradient)
    and the matching ``W`` (weight gradient) is deferred by ``w_lag`` backwards. ``after_backward
    (position, microbatch)`` returns actions to append after the ``position``-th backward (a STEP
    for asynchronous schedules).
    """
    count = len(microbatches)
    warm = min(max(warmup, 0), count)
    new = tuple.__new__
    forwards = [new(Action, (_F, stage, k, None, None)) for k in microbatches]
    program = forwards[:warm]
    append = program.append
    extend = program.extend
    backward_kind = _I if split_backward else _B
    weights_done = 0
    for position in range(count):
        if position + warm < count:
            append(forwards[position + warm])
        k = microbatches[position]
        append(new(Action, (backward_kind, stage, k, None, None)))
        if split_backward and position >= w_lag:
            append(new(Action, (_W, stage, microbatches[position - w_lag], None, None)))
            weights_done = position - w_lag + 1
        if after_backward is not None:
            extend(after_backward(position, k))
    if split_backward:
        program.extend(new(Action, (_W, stage, k, None, None)) for k in microbatches[weights_done:])
    return program


def stage_placement(replicas: Sequence[int]) -> list[list[int]]:
    """Ranks of each stage's replicas, numbered from the input stage: ``[2, 1]`` -> ``[[0, 1], [2]]``."""
    placement, next_rank = [], 0
    for count in replicas:
        placement.append(list(range(next_rank, next_rank + count)))
        next_rank += count
    return placement


def warmup_depths(replicas: Sequence[int]) -> list[int]:
    """PipeDream's warm-up depth per stage (forwards before the first backward, per replica).

    ``W_s = floor((N - 1 - sum_{i<s} r_i) / r_s)`` for N workers; a straight pipeline gives
    ``(S-1, ..., 1, 0)``. Stage 0 keeps ``W_0 + 1 = ceil(N / r_0)`` minibatches in flight (NOAM).
    """
    workers = sum(replicas)
    depths, before = [], 0
    for count in replicas:
        depths.append((workers - 1 - before) // count)
        before += count
    return depths
