"""A greedy list scheduler: one step's compute order for any placement, given costs and memory.

The zero-bubble papers (Qi et al. 2023, 2024) order the split backward by simulating time: a
rank that is free runs the most urgent action whose inputs are there. Here the urgency is

    1. I (input gradient): on the critical path back to stage 0;
    2. F, if the rank's activation memory allows it: a later stage (the V's second chunk) first;
    3. W (weight gradient): only what is left, so W fills the gaps.

Memory counts microbatches whose activations a rank holds (from F to I, as
:mod:`~pipetrain.schedule.memory` does), in units of one stage of this placement. When a
microbatch first enters a rank, the rank *reserves* a unit for each later stage it holds (a V rank
holds two: the microbatch will come back), so that a full rank can always finish the
microbatches it has started and the order never deadlocks (at least one unit per held stage is
needed). Within a stage, forwards, input gradients and weight gradients each run in microbatch
order.

The order is computed for one step; the generators repeat it for every step with a flush.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.ir import Action, Kind

__all__ = ["greedy_order"]

_F, _I, _W = Kind.F, Kind.I, Kind.W


def greedy_order(
    placement: Sequence[int],
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    limits: Sequence[int],
) -> list[list[Action]]:
    """Per rank, the compute actions (F, I, W) of one step of ``microbatches``.

    ``placement[s]``: the rank of stage ``s``; ``forward``/``backward``/``weight``: per-stage F, I
    and W times; ``limits[r]``: the most activation units rank ``r`` may hold or reserve.
    """
    stages = len(placement)
    ranks = max(placement) + 1
    held = [[s for s in range(stages) if placement[s] == r] for r in range(ranks)]
    for rank, stages_held in enumerate(held):
        if limits[rank] < len(stages_held):
            raise ScheduleError(
                f"rank {rank} holds {len(stages_held)} stages, so its activation limit must be at least "
                f"{len(stages_held)}, got {limits[rank]}: raise {option('memory_limit')}"
            )
    m = microbatches
    done_f = [[-1.0] * m for _ in range(stages)]  # end time of F(s, k); -1 while not scheduled
    done_i = [[-1.0] * m for _ in range(stages)]
    next_f = [0] * stages
    next_i = [0] * stages
    next_w = [0] * stages
    committed = [0] * ranks  # activation units held
    clocks = [0.0] * ranks
    remaining = [3 * m * len(h) for h in held]
    programs: list[list[Action]] = [[] for _ in range(ranks)]
    last = stages - 1
    new = tuple.__new__

    def f_ready(s: int, k: int) -> float | None:
        if k >= m:
            return None
        if s == 0:
            return 0.0
        end = done_f[s - 1][k]
        return end if end >= 0 else None

    def i_ready(s: int, k: int) -> float | None:
        if k >= m or done_f[s][k] < 0:
            return None
        if s == last:
            return done_f[s][k]
        end = done_i[s + 1][k]
        return end if end >= 0 else None

    def later_stages(rank: int, s: int) -> int:
        return sum(1 for t in held[rank] if t > s)

    # ranks by (clock, sequence): the free rank with the earliest clock chooses next; a rank with
    # nothing ready waits for the next time something on it or elsewhere can change
    sequence = 0
    heap = [(0.0, rank, rank) for rank in range(ranks)]
    heapq.heapify(heap)
    stalled = 0
    while heap:
        t, _, rank = heapq.heappop(heap)
        if remaining[rank] == 0:
            continue
        t = clocks[rank] = max(clocks[rank], t)
        choice = None
        future: list[float] = []
        # 1. input gradients, the oldest microbatch first
        best = None
        for s in held[rank]:
            k = next_i[s]
            ready = i_ready(s, k)
            if ready is None:
                continue
            if ready <= t:
                if best is None or (k, s) < best:
                    best = (k, s)
            else:
                future.append(ready)
        if best is not None:
            choice = (_I, best[1], best[0])
        if choice is None:  # 2. forwards within memory, the later stage first
            for s in sorted(held[rank], reverse=True):
                k = next_f[s]
                ready = f_ready(s, k)
                if ready is None:
                    continue
                if committed[rank] + later_stages(rank, s) >= limits[rank]:
                    continue
                if ready <= t:
                    choice = (_F, s, k)
                    break
                future.append(ready)
        if choice is None:  # 3. weight gradients, the oldest first
            best = None
            for s in held[rank]:
                k = next_w[s]
                if k < next_i[s] and (best is None or (k, s) < best):
                    best = (k, s)
            if best is not None:
                choice = (_W, best[1], best[0])
        if choice is None:
            others = [clocks[r] for r in range(ranks) if r != rank and remaining[r] and clocks[r] > t]
            wake = min(future + others, default=None)
            stalled += 1
            if stalled > 2 * ranks + 2 and wake is None:
                raise ScheduleError("the greedy order cannot go on (no rank can run anything); "
                                    f"raise {option('memory_limit')}")  # pragma: no cover - guarded by limits
            sequence += 1
            heapq.heappush(heap, (wake if wake is not None else t, ranks + sequence, rank))
            continue
        stalled = 0
        kind, s, k = choice
        if kind is _F:
            committed[rank] += 1
            end = t + forward[s]
            done_f[s][k] = end
            next_f[s] += 1
        elif kind is _I:
            end = t + backward[s]
            done_i[s][k] = end
            next_i[s] += 1
            committed[rank] -= 1
        else:
            end = t + weight[s]
            next_w[s] += 1
        programs[rank].append(new(Action, (kind, s, k, None, None)))
        remaining[rank] -= 1
        clocks[rank] = end
        sequence += 1
        heapq.heappush(heap, (end, rank, rank))
    return programs
