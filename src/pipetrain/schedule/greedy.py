"""A greedy list scheduler: one step's compute order for any placement, given costs and memory.

The zero-bubble papers (Qi et al. 2023, 2024) order the split backward by simulating time: a
rank that is free runs the most urgent action whose inputs are there. Here the urgency is

    1. I (input gradient): on the critical path back to stage 0;
    2. F, if the rank's activation memory allows it: a microbatch coming back (the V's second
       chunk) before one entering the rank;
    3. W (weight gradient): only what is left, so W fills the gaps.

Memory counts the microbatches whose activations a rank holds, in units of one stage of this
placement: from F to W (``until_w``: what pipetrain's executor keeps, the microbatch's graph), or
from F to I as :mod:`~pipetrain.schedule.memory` counts (the papers' activation memory; W keeps
only its inputs and output gradients there). An F
leaves one unit free for each later stage its rank holds (a V rank keeps one for the
microbatches coming back), so the microbatch furthest along can always go on and the order never
deadlocks (a rank's limit must be at least the stages it holds). Within a stage, forwards, input
gradients and weight gradients each run in microbatch order.

The order is computed for one step; the generators repeat it for every step with a flush.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.ir import Action, Kind

__all__ = ["greedy_order"]

#: I, then a forward of a microbatch the rank has seen (the V's second chunk), then one entering
#: the rank (``F0``: on its first stage), then W.
_PRIORITY = ("I", "F", "F0", "W")

_F, _I, _W = Kind.F, Kind.I, Kind.W


def greedy_order(
    placement: Sequence[int],
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    limits: Sequence[int],
    *,
    until_w: bool = True,
) -> list[list[Action]]:
    """Per rank, the compute actions (F, I, W) of one step of ``microbatches``.

    ``placement[s]``: the rank of stage ``s``; ``forward``/``backward``/``weight``: per-stage F, I
    and W times; ``limits[r]``: the most activation units rank ``r`` may hold; ``until_w``: a
    microbatch holds its unit until its W (else until its I).
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

    def pick_input(rank: int, t: float, future: list[float]) -> tuple | None:
        best = None  # the oldest microbatch first
        for s in held[rank]:
            k = next_i[s]
            ready = i_ready(s, k)
            if ready is None:
                continue
            if ready > t:
                future.append(ready)
            elif best is None or (k, s) < best:
                best = (k, s)
        return None if best is None else (_I, best[1], best[0])

    def pick_forward(entering: bool) -> Callable[[int, float, list[float]], tuple | None]:
        def pick(rank: int, t: float, future: list[float]) -> tuple | None:
            for s in sorted(held[rank], reverse=True):  # the later stage first
                if (s == held[rank][0]) != entering:
                    continue
                k = next_f[s]
                ready = f_ready(s, k)
                if ready is None or committed[rank] + later_stages(rank, s) >= limits[rank]:
                    continue
                if ready <= t:
                    return (_F, s, k)
                future.append(ready)
            return None
        return pick

    def pick_weight(rank: int, t: float, future: list[float]) -> tuple | None:
        best = None  # the oldest first
        for s in held[rank]:
            k = next_w[s]
            if k < next_i[s] and (best is None or (k, s) < best):
                best = (k, s)
        return None if best is None else (_W, best[1], best[0])

    pick = {"I": pick_input, "F": pick_forward(False), "F0": pick_forward(True), "W": pick_weight}
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
        future: list[float] = []
        choice = None
        for what in _PRIORITY:
            choice = pick[what](rank, t, future)
            if choice is not None:
                break
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
            if not until_w:
                committed[rank] -= 1
        else:
            end = t + weight[s]
            next_w[s] += 1
            if until_w:
                committed[rank] -= 1
        programs[rank].append(new(Action, (kind, s, k, None, None)))
        remaining[rank] -= 1
        clocks[rank] = end
        sequence += 1
        heapq.heappush(heap, (end, rank, rank))
    return programs
