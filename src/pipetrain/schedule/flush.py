"""Synchronous schedules that flush after every step: GPipe, 1F1B (PipeDream-Flush), ZB-H1, ZB-H2.

With S = 4 stages and m = 4 microbatches (one step)::

    gpipe    stage 0: F0 F1 F2 F3 B0 B1 B2 B3 STEP
    1f1b     stage 0: F0 F1 F2 F3 B0 B1 B2 B3 STEP      (warm-up S-1-s = 3, then 1F1B)
             stage 3: F0 B0 F1 B1 F2 B2 F3 B3 STEP      (warm-up 0)
    zb-h1    stage 3: F0 I0 F1 I1 W0 ...                 (W deferred by s backwards)
    zb-h2    stage 0: F0 .. F5 F6 I0 W0 F7 I1 W1 ...     (warm-up 2(S-1-s), W deferred by 2s)

Every microbatch of step t reads version t: one weight version, exact gradient accumulation.
"""

from __future__ import annotations

import functools
from math import lcm
from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.ir import Action, Kind, Schedule
from pipetrain.schedule.params import check_positive, normalise_replicas
from pipetrain.schedule.stream import one_forward_one_backward, stage_placement, warmup_depths

__all__ = ["gpipe", "one_f_one_b", "zb_h1", "zb_h2", "flushing_programs", "update_actions"]


@functools.lru_cache(maxsize=None)
def update_actions(stage: int, replicated: bool) -> tuple[Action, ...]:
    """The actions that end an accumulation: SYNC among replicas (if any), then STEP."""
    if replicated:
        return (Action(Kind.SYNC, stage), Action(Kind.STEP, stage))
    return (Action(Kind.STEP, stage),)


def flushing_programs(
    stages: int,
    microbatches: int,
    steps: int,
    replicas: Sequence[int],
    warmup: Sequence[int],
    *,
    split_backward: bool = False,
    w_lags: Sequence[int] | None = None,
) -> tuple[list[list[Action]], list[list[int]]]:
    """Compute programs of a flushing schedule: per step, a 1F1B stream with the given warm-ups."""
    placement = stage_placement(replicas)
    programs: list[list[Action]] = [[] for _ in range(sum(replicas))]
    for stage, ranks in enumerate(placement):
        count = len(ranks)
        for replica, rank in enumerate(ranks):
            program = programs[rank]
            for step in range(steps):
                local = [k for k in range(step * microbatches, (step + 1) * microbatches) if k % count == replica]
                program.extend(
                    one_forward_one_backward(
                        stage,
                        local,
                        warmup[stage],
                        split_backward=split_backward,
                        w_lag=w_lags[stage] if w_lags else 0,
                    )
                )
                program.extend(update_actions(stage, count > 1))
    return programs, placement


def _check(stages: int, microbatches: int, steps: int, replicas: Sequence[int] | None, name: str) -> list[int]:
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("steps", steps)
    counts = normalise_replicas(stages, replicas, name)
    for stage, count in enumerate(counts):
        if microbatches % count:
            raise ScheduleError(
                f"{name}: stage {stage} has {count} replicas, so the microbatches of a step ({microbatches}) must "
                f"divide evenly among them; use {option('microbatches', _multiple_at_least(microbatches, counts))}"
            )
    return counts


def _multiple_at_least(value: int, counts: Sequence[int]) -> int:
    step = lcm(*counts)
    return max(step, -(-value // step) * step)


def gpipe(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """GPipe: all forwards of a step, then all backwards (in the same order), then the update."""
    counts = _check(stages, microbatches, steps, replicas, "gpipe")
    warm = [microbatches] * stages
    programs, placement = flushing_programs(stages, microbatches, steps, counts, warm)
    return Schedule(programs, placement, name="gpipe", policy="flush", microbatches=microbatches, steps=steps)


def one_f_one_b(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """1F1B with a flush after every step (PipeDream-Flush): warm-up ``S-1-s``, then alternate."""
    counts = _check(stages, microbatches, steps, replicas, "1f1b")
    programs, placement = flushing_programs(stages, microbatches, steps, counts, warmup_depths(counts))
    return Schedule(programs, placement, name="1f1b", policy="flush", microbatches=microbatches, steps=steps)


def zb_h1(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """ZB-H1 (Qi et al., 2024): 1F1B with the backward split into I and W.

    I (input gradient) stays on the critical path; stage ``s`` defers each W by ``s`` backwards so
    that W fills the bubbles that the returning gradients leave. Activations are freed after I,
    so the peak activation count per stage equals 1F1B's; every stage holds at most ``S`` pending
    weight gradients (the 1F1B peak of stage 0). With balanced costs and ``m >= S`` the makespan is
    ``m(F+B+W) + (S-1)(F+B-W)``, B being the input-gradient time.
    """
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"zb-h1 does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    counts = _check(stages, microbatches, steps, None, "zb-h1")
    lags = list(range(stages))
    programs, placement = flushing_programs(
        stages, microbatches, steps, counts, warmup_depths(counts), split_backward=True, w_lags=lags
    )
    return Schedule(programs, placement, name="zb-h1", policy="flush", microbatches=microbatches, steps=steps)


def zb_h2(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """ZB-H2 (Qi et al., 2023): twice 1F1B's warm-up, and W deferred by ``2s`` backwards on stage ``s``.

    Stage ``s`` runs ``2(S-1-s)`` warm-up forwards (peak activations ``2(S-s)-1``, ``2S-1`` on stage
    0: about twice 1F1B's ``S``), so the first input gradient arrives just as its forwards run out;
    the last stage then runs F, I, F, I with its W deferred, which brings the input gradients back
    to stage 0 early, and the W fill the end. At F = I = W = 1 (``m >= 2S-1``) stage s is busy
    without a gap from time ``s`` to ``3m + s``: a parallelogram, so the next step's forwards follow
    at once and ``n`` steps take ``3mn + S - 1``, idle only at the first step's start and the last
    one's end.
    """
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"zb-h2 does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    counts = _check(stages, microbatches, steps, None, "zb-h2")
    warm = [2 * (stages - 1 - stage) for stage in range(stages)]
    lags = [2 * stage for stage in range(stages)]
    programs, placement = flushing_programs(
        stages, microbatches, steps, counts, warm, split_backward=True, w_lags=lags
    )
    return Schedule(programs, placement, name="zb-h2", policy="flush", microbatches=microbatches, steps=steps)
