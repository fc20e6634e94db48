"""Asynchronous 1F1B without flushes: PipeDream (weight stashing, vertical sync) and PipeDream-2BW.

PipeDream, straight 4-stage pipeline (warm-up W_s = 3, 2, 1, 0), updates after every backward::

    stage 0: F0 F1 F2 F3 B0 STEP F4 B1 STEP F5 B2 STEP ...
    stage 3: F0 B0 STEP F1 B1 STEP F2 B2 STEP ...

so minibatch k meets version ``max(0, k - W_s)`` at stage s (docs/design.md 3.2). Replicated stages
(1F1B-RR) send minibatch k to replica ``k mod r_s``; the replicas average gradients (SYNC) before
each update. 2BW runs the same order over batches of m microbatches and updates once per batch.
"""

from __future__ import annotations

from math import lcm
from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.ir import Action, Schedule
from pipetrain.schedule.params import check_positive, normalise_replicas
from pipetrain.schedule.stream import one_forward_one_backward, stage_placement, warmup_depths

__all__ = ["pipedream", "two_bw", "asynchronous_programs"]


def asynchronous_programs(
    total: int,
    replicas: Sequence[int],
    warmup: Sequence[int],
    update_every: int,
) -> tuple[list[list[Action]], list[list[int]]]:
    """One continuous 1F1B stream per replica over ``total`` units, an update every
    ``update_every`` local backwards (and after the last one)."""
    placement = stage_placement(replicas)
    programs: list[list[Action]] = [[] for _ in range(sum(replicas))]
    for stage, ranks in enumerate(placement):
        count = len(ranks)
        for replica, rank in enumerate(ranks):
            local = list(range(replica, total, count))
            last = len(local) - 1

            def after_backward(position: int, _k: int, stage: int = stage, last: int = last) -> tuple[Action, ...]:
                if (position + 1) % update_every == 0 or position == last:
                    return update_actions(stage, count > 1)
                return ()

            programs[rank] = one_forward_one_backward(stage, local, warmup[stage], after_backward=after_backward)
    return programs, placement


def _check_divisible(total: int, counts: Sequence[int], what: str, name: str) -> None:
    step = lcm(*counts)
    if total % step:
        fixed = max(step, -(-total // step) * step)
        raise ScheduleError(
            f"{name}: with replicas {list(counts)} the {what} ({total}) must divide evenly among every stage's "
            f"replicas (a multiple of {step}), so that replicas update together; use {option('microbatches', fixed)}"
        )


def pipedream(
    stages: int,
    microbatches: int,
    replicas: Sequence[int] | None = None,
    update_every: int = 1,
) -> Schedule:
    """PipeDream: ``microbatches`` minibatches streamed with NOAM warm-up, no flush, ever.

    Each minibatch is its own update (or every ``update_every`` minibatches per replica).
    """
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("update_every", update_every)
    counts = normalise_replicas(stages, replicas, "pipedream")
    _check_divisible(microbatches, counts, "minibatches", "pipedream")
    programs, placement = asynchronous_programs(microbatches, counts, warmup_depths(counts), update_every)
    return Schedule(programs, placement, name="pipedream", policy="stash", microbatches=microbatches, steps=1)


def two_bw(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream-2BW: 1F1B without flushes over batches of ``microbatches`` (m >= S), one update per
    batch; batch t reads version ``max(0, t-1)`` (double-buffered weights)."""
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("steps", steps)
    counts = normalise_replicas(stages, replicas, "2bw")
    if microbatches < stages:
        raise ScheduleError(
            f"2bw needs at least as many microbatches per batch as stages (m >= S) so that the version a batch "
            f"reads exists when it starts; got m = {microbatches} < S = {stages}: use {option('microbatches', stages)} "
            f"or more"
        )
    _check_divisible(microbatches, counts, "microbatches of a batch", "2bw")
    placement = stage_placement(counts)
    warm = warmup_depths(counts)
    programs: list[list[Action]] = [[] for _ in range(sum(counts))]
    total = microbatches * steps
    for stage, ranks in enumerate(placement):
        count = len(ranks)
        for replica, rank in enumerate(ranks):
            local = list(range(replica, total, count))
            per_batch = microbatches // count

            def after_backward(position: int, _k: int, stage: int = stage, per_batch: int = per_batch) -> tuple[Action, ...]:
                return update_actions(stage, count > 1) if (position + 1) % per_batch == 0 else ()

            programs[rank] = one_forward_one_backward(stage, local, warm[stage], after_backward=after_backward)
    return Schedule(programs, placement, name="2bw", policy="2bw", microbatches=microbatches, steps=steps)
