"""Pipelined Backpropagation (Kosson et al., MLSys 2021): fine-grained, one sample at a time.

In tick t, stage s runs the forward of sample ``t - s`` and the backward of sample
``t - (2S - 2 - s)``; the last stage runs forward, loss and backward of a sample in one tick. Per
stage that is a 1F1B stream with ``D_s = 2(S-1-s)`` warm-up forwards and an update after every
backward. S = 3 (samples 0..4)::

    tick:     0    1    2       3       4       5       6
    stage 0:  F0   F1   F2      F3 B0   F4 B1   B2      B3 ...
    stage 1:       F0   F1      F2 B0   F3 B1   F4 B2   B3 ...
    stage 2:            F0 B0   F1 B1   F2 B2   F3 B3   F4 B4

The forward of sample n at stage s reads version ``max(0, n - D_s)``; with the ``latest`` policy the
backward reads the weights current at backward time (version n), as PB hardware does.
"""

from __future__ import annotations

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.ir import Schedule
from pipetrain.schedule.params import check_positive
from pipetrain.schedule.pipedream import asynchronous_programs

__all__ = ["pb", "pb_delays"]


def pb_delays(stages: int) -> list[int]:
    """Gradient delay of each stage in updates: ``D_s = 2(S-1-s)``; S = 5 gives (8, 6, 4, 2, 0)."""
    return [2 * (stages - 1 - s) for s in range(stages)]


def pb(stages: int, microbatches: int, update_every: int = 1, replicas=None) -> Schedule:
    """Pipelined Backpropagation over ``microbatches`` samples (or microbatches), each an update."""
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("update_every", update_every)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"pb does not replicate stages (every layer is its own stage); drop {option('replicas')}")
    programs, placement = asynchronous_programs(microbatches, [1] * stages, pb_delays(stages), update_every)
    return Schedule(programs, placement, name="pb", policy="latest", microbatches=microbatches, steps=1)
