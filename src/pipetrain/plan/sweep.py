"""The machine-count sweep: PipeDream's partitioning DP filled one machine count at a time.

One topology level's table holds, for every machine count ``M``, table row ``r`` (a start cut)
and end cut ``j``, the best pipeline over ``r -> j`` on exactly ``M`` machines::

    A[M][r -> j] = min( first(r -> j, M),                          # one stage on all M
                        A[M - 1][r -> j]          (idle workers allowed),
                        min over cuts k, m < M of max(A[M - m][r -> k], last(k -> j, m)) )

``last`` prices the last stage (its input transfer, compute and all-reduce, output transfer).
Written out, the inner min tries every (k, m): ``O(M)`` per cut, ``O(n^2)`` per range over a
level of ``n`` machines, which is what made 1,024 flat workers take a minute. The sweep makes the
min over ``m`` cost ``O(1)`` amortised per (row, k, j) and machine count, exactly:

1. ``last(k -> j, m)`` does not grow with ``m`` once ``m >= 2``: compute ``/ m``, an all-reduce
   of ``4 (m-1)/m^2 * params / B`` (largest at ``m = 2``), transfers ``/ m`` (or constant), and
   memory per worker falls as replicas share the in-flight work. (From 1 to 2 replicas a stage can
   get slower, so ``m = 1`` is priced on its own.)
2. For ``m >= 2``, ``A[M - m]`` may be replaced by its running minimum over machine counts,
   ``P[M'] = min over M'' <= M' of A[M'']``, without changing the min: the option behind
   ``P[M']`` (``M'' <= M'`` machines for the prefix) gives the last stage ``M - M'' >= m``
   replicas, so it is no slower.
3. In ``M' = M - m``, ``P[M']`` falls and ``last(k -> j, M - M')`` rises, so the min of their max
   sits where they cross; and as ``M`` grows ``last`` only falls, so the crossing never moves
   back. One pointer per (row, k, j) walks forward: at most ``n`` steps over the whole sweep.

Each machine count is one vectorised step over every (row, k, j) triple at once, then a
segmented min per (row, j). The work is about ``n * triples``, which is also what the planner
checks before it starts (:mod:`pipetrain.plan.effort`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Ranges", "build_ranges", "solve_table", "best_split"]

# (pairs, replicas, machines of the whole entry) -> seconds (or bytes); replicas >= 1
Cost = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
_STATIC_TABLE = 16_000_000   # largest table of last-stage costs per replica count kept (128 MB)
_BLOCK = 16_384              # triples per block of a step (their state stays in cache)
_STEPS = 2                   # pointer steps one at a time before a binary search for the rest


@dataclass
class Ranges:
    """Every (row, k, j) triple the DP of one level looks at.

    ``rows`` are the start cuts of the table rows; a *pair* is a last stage ``k -> j``
    (``pair_k``, ``pair_j``); a triple is (table row, pair) with ``r -> k`` and ``k -> j`` both
    stages. Triples are sorted by (row, j): ``heads`` are the first triple of each (row, j) group
    and ``groups`` its flat index ``row * states + j`` in a table row of ``rows * states``.
    """

    rows: np.ndarray
    states: int
    pair_k: np.ndarray
    pair_j: np.ndarray
    pair_id: np.ndarray     # (states, states): pair index of k -> j, -1 if not a pair
    row: np.ndarray         # per triple: table row index
    pair: np.ndarray        # per triple: pair index
    prefix: np.ndarray      # per triple: flat index row * states + k of its prefix r -> k
    heads: np.ndarray
    groups: np.ndarray

    @property
    def triples(self) -> int:
        return int(self.pair.size)


def build_ranges(ancestors: np.ndarray, rows: np.ndarray, band: np.ndarray | None = None,
                 row_band: np.ndarray | None = None) -> Ranges:
    """The triples of a level whose rows start at ``rows``.

    ``ancestors[k, j]``: ``k -> j`` is a stage (states in topological order, so ``k < j``).
    ``band[k, j]``: a last stage ``k -> j`` may be used; ``row_band[i, j]``: row ``i`` is solved
    for end cut ``j`` (None: every stage).
    """
    states = ancestors.shape[0]
    allowed = ancestors.copy()
    allowed[0] = False                      # a last stage starts after at least one layer
    if band is not None:
        allowed &= band
    by_end = np.ascontiguousarray(allowed.T)              # [j, k]
    pair_j, pair_k = np.nonzero(by_end)     # numbered by j, then k: a group's pairs are
    pair_id = np.full((states, states), -1, dtype=np.int64)    # consecutive
    pair_id[pair_k, pair_j] = np.arange(pair_k.size)
    rows = np.asarray(rows, dtype=np.int64)
    chunks_row, chunks_pair = [], []
    for index, r in enumerate(rows):
        ends = ancestors[r] if row_band is None else ancestors[r] & row_band[index]
        last = int(np.flatnonzero(ends)[-1]) if ends.any() else -1
        if last <= r + 1:
            continue
        inner = slice(r + 1, last + 1)
        if rows.size == 1 and ends[inner].all() and ancestors[r, inner].all():
            chosen = np.flatnonzero((pair_k > r) & (pair_j <= last))  # every pair after r
        else:
            # k -> j with r -> k a stage, grouped by j (nonzero of [j, k]: j-major, then k)
            mask = ancestors[r, inner][None, :] & by_end[inner, inner] & ends[inner][:, None]
            jj, kk = np.nonzero(mask)
            chosen = pair_id[kk + r + 1, jj + r + 1]
        if chosen.size:
            chunks_row.append(np.full(chosen.size, index, dtype=np.int64))
            chunks_pair.append(chosen)
    row = np.concatenate(chunks_row) if chunks_row else np.zeros(0, dtype=np.int64)
    pair = np.concatenate(chunks_pair) if chunks_pair else np.zeros(0, dtype=np.int64)
    key = row * states + pair_j[pair]
    heads = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else key
    return Ranges(rows=rows, states=states, pair_k=pair_k, pair_j=pair_j, pair_id=pair_id,
                  row=row, pair=pair, prefix=row * states + pair_k[pair], heads=heads,
                  groups=key[heads])


def _tabulate(cost: Cost, pairs: int, machines: int) -> np.ndarray | None:
    """``table[pair, m]`` of a cost that ignores the entry's machine count, if small enough.

    Only for the crossings: ``m = 1`` (never a crossing, priced on its own) is left ``inf``.
    """
    if (machines + 1) * pairs > _STATIC_TABLE or pairs == 0:
        return None
    table = np.full((pairs, machines + 1), np.inf)
    every = np.arange(pairs)
    for m in range(2, machines + 1):
        table[:, m] = cost(every, np.full(pairs, m), machines)
    return table


class _Crossings:
    """The crossing pointer of every triple, and the last stage's cost at it.

    ``pointer[t]`` is the prefix machine count ``M'`` of triple ``t``. The running minimum is
    kept transposed, ``P[(row, k), M']``, so that a triple's ``P[M']`` and its neighbours' (same
    row, next k) sit close in memory; ``base + pointer`` is the flat index of ``P[pointer]``.
    With a tabulated cost, ``lookup + M`` is the flat index of ``cost[pair, M - pointer]``.
    ``here`` caches ``P[pointer]`` and ``left`` ``P[pointer - 1]``: entries below the machine
    count being filled are final, so both change only when a pointer moves.
    """

    def __init__(self, pair: np.ndarray, prefix: np.ndarray, last: Cost,
                 table: np.ndarray | None, machines: int, start: np.ndarray | None = None,
                 fits: Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None = None):
        self.pair = pair
        self.fits = fits
        self.pointer = np.ones(self.pair.size, dtype=np.int64) if start is None else \
            np.maximum(np.asarray(start, dtype=np.int64), 1)
        stride = machines + 1
        self.base = prefix * stride
        self.last = last
        self.table = None if table is None else table.ravel()
        if table is not None:
            self.lookup = self.pair * stride - self.pointer
        self.left = np.full(self.pair.size, np.inf)      # P[pointer - 1]; P[0] = inf
        self.here: np.ndarray | None = None

    def cost(self, t: np.ndarray, pointer: np.ndarray, machines: int) -> np.ndarray:
        """Cost of the last stage of triples ``t`` on ``machines - pointer`` replicas."""
        m = machines - pointer
        if self.table is not None:
            cost = np.take(self.table, self.lookup[t] + self.pointer[t] - pointer + machines)
        else:
            cost = self.last(self.pair[t], m, machines)
        if self.fits is not None:
            cost[~self.fits(self.pair[t], m, machines)] = np.inf
        return cost

    def jump(self, movers: np.ndarray, cost: np.ndarray, machines: int,
             running: np.ndarray, here: np.ndarray) -> None:
        """Move ``movers`` straight to their crossing by binary search (for long moves)."""
        lo = self.pointer[movers] + 1                   # P[pointer] > cost: not there
        hi = np.full(movers.size, machines - 1, dtype=np.int64)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                break
            t = movers[open_]
            mid = (lo[open_] + hi[open_]) >> 1
            crossed = np.take(running, self.base[t] + mid) <= self.cost(t, mid, machines)
            hi[open_] = np.where(crossed, mid, hi[open_])
            lo[open_] = np.where(crossed, lo[open_], mid + 1)
        new = np.full(movers.size, np.inf)
        inside = lo <= machines - 2
        new[inside] = self.cost(movers[inside], lo[inside], machines)
        if self.table is not None:
            self.lookup[movers] -= lo - self.pointer[movers]
        self.pointer[movers] = lo
        self.left[movers] = np.take(running, self.base[movers] + lo - 1)
        here[movers] = np.take(running, self.base[movers] + lo)
        cost[movers] = new

    def at(self, t: np.ndarray | None, machines: int) -> np.ndarray:
        """Cost of the last stage of triples ``t`` (None: all) on ``machines - pointer``."""
        if self.table is not None:
            cost = np.take(self.table, (self.lookup if t is None else self.lookup[t]) + machines)
        elif t is None:
            cost = self.last(self.pair, machines - self.pointer, machines)
        else:
            cost = self.last(self.pair[t], machines - self.pointer[t], machines)
        if self.fits is not None:
            pair, pointer = (self.pair, self.pointer) if t is None else \
                (self.pair[t], self.pointer[t])
            cost[~self.fits(pair, machines - pointer, machines)] = np.inf
        return cost

    def _move(self, movers: np.ndarray, cost: np.ndarray, machines: int,
              running: np.ndarray, here: np.ndarray) -> np.ndarray:
        """Move ``movers`` one machine on; returns those that must move again. ``cost`` and
        ``here`` (indexed like ``movers``' positions) are updated."""
        self.left[movers] = here[movers]
        pointer = self.pointer[movers] + 1
        self.pointer[movers] = pointer
        if self.table is not None:
            self.lookup[movers] -= 1
        new = self.at(movers, machines)
        if self.table is None:                          # (the table holds inf at m = 1)
            new[pointer > machines - 2] = np.inf        # no room for a replicated last stage
        cost[movers] = new
        value = np.take(running, self.base[movers] + pointer)
        here[movers] = value
        return movers[value > new]

    def advance(self, machines: int, running: np.ndarray, active: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Move the pointers of the ``active`` triples (None: all) to the first
        ``M' <= machines - 2`` with ``P[M'] <= last(M - M')`` (``machines - 1`` if none).

        Returns, per active triple, the two candidates: ``P[pointer - 1]`` (the prefix just
        left of the crossing) and the last stage's cost at the pointer (``inf`` if none). A
        pointer moves by 0 or 1 per machine count in the main.
        """
        if active is None:
            cost = self.at(None, machines)
            if self.here is None:
                self.here = np.take(running, self.base + self.pointer)
            movers = np.flatnonzero(self.here > cost)
            for _ in range(_STEPS):
                if not movers.size:
                    break
                movers = self._move(movers, cost, machines, running, self.here)
            if movers.size:
                self.jump(movers, cost, machines, running, self.here)
            return self.left, cost
        # a window: pointers start where their prefix can first run, so none is cached
        cost = self.at(active, machines)
        pointer = self.pointer[active]
        cost[pointer > machines - 2] = np.inf
        here = np.full(self.pair.size, np.inf)
        here[active] = np.take(running, self.base[active] + pointer)
        full = np.full(self.pair.size, np.inf)
        full[active] = cost
        movers = active[here[active] > cost]
        for _ in range(_STEPS):
            if not movers.size:
                break
            movers = self._move(movers, full, machines, running, here)
        if movers.size:
            self.jump(movers, full, machines, running, here)
        return self.left[active], full[active]


def solve_table(n: int, ranges: Ranges, first: Callable[[int], np.ndarray], last: Cost, *,
                replicate: bool = True, fewer: bool = False,
                keep: Callable[[int, np.ndarray], None] | None = None, static: bool = False,
                fits: Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None = None,
                windows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                bound: float = np.inf,
                progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``A[M]`` for ``M = 1..n``; returns ``A`` and its running minimum ``P``, both
    ``(n + 1, rows * states)`` (row ``M`` flat over (table row, end cut); ``A[0]`` is ``inf``).

    ``first(M)`` prices one stage on all ``M`` machines for every (row, j), flat (``inf`` where
    that is no stage); ``last(pairs, m, M)`` the last stage of an ``M``-machine pipeline on ``m``
    replicas, non-increasing in ``m >= 2`` and no larger at ``(m + 1, M + 1)`` than at
    ``(m, M)``. ``replicate=False``: one replica per stage. ``keep(M, row)`` may set entries of a
    finished row to ``inf`` (a band). ``static``: ``last`` ignores ``M`` (then it may be
    tabulated). ``fits(pairs, m, M)``: where False the last stage is ``inf`` (a memory limit;
    true at ``(m + 1, M + 1)`` wherever at ``(m, M)``).

    ``bound``: entries above it are ``inf`` (a plan no slower than it is known). Then
    ``windows = (prefix, start, stop)`` may say, per triple, the fewest machines its prefix
    ``r -> k`` can run on within the bound and the machine counts ``start..stop`` at which the
    triple can price an entry within it (outside, its options are slower or its entry is in no
    plan of ``n`` machines): the sweep only visits triples in their window.
    """
    width = len(ranges.rows) * ranges.states
    table = np.full((n + 1, width), np.inf)
    running = np.full((width, n + 1), np.inf)      # transposed: P[(row, k), M']
    flat_running = running.ravel()
    pairs = ranges.pair_k.size
    tabulated = _tabulate(last, pairs, n) if static else None
    pair, prefix, heads, groups = ranges.pair, ranges.prefix, ranges.heads, ranges.groups
    every = np.arange(pairs)
    alone = None                          # m = 1, per triple
    if windows is None:
        # blocks of whole (row, j) groups small enough to stay in cache through a step
        cuts = heads[np.searchsorted(heads, np.arange(0, pair.size, _BLOCK))] \
            if pair.size else heads
        edges = np.r_[np.unique(cuts), pair.size]
        blocks = [(slice(a, b), np.searchsorted(heads, a), np.searchsorted(heads, b))
                  for a, b in zip(edges[:-1], edges[1:])]
        crossings = [_Crossings(pair[part], prefix[part], last, tabulated, n, fits=fits)
                     for part, _, _ in blocks]
    else:
        crossing = _Crossings(pair, prefix, last, tabulated, n, windows[0], fits)
        group_of = np.repeat(np.arange(heads.size), np.diff(np.r_[heads, pair.size]))
    for machines in range(1, n + 1):
        row = np.array(first(machines), dtype=np.float64).reshape(width)
        if pair.size and machines >= 2:
            before = table[machines - 1]
            crossed = replicate and machines >= 3
            if windows is None:
                if alone is None or not static or fits is not None:
                    alone = np.take(_alone(last, fits, every, machines), pair)
                for (part, h0, h1), crossing_part in zip(blocks, crossings):
                    value = np.maximum(np.take(before, prefix[part]), alone[part])
                    if crossed:
                        # left of the crossing the prefix is the slower part, at it the last
                        # stage
                        left, right = crossing_part.advance(machines, flat_running)
                        np.minimum(value, np.minimum(left, right), out=value)
                    where = groups[h0:h1]
                    row[where] = np.minimum(row[where],
                                            np.minimum.reduceat(value, heads[h0:h1] - part.start))
            else:
                active = np.flatnonzero((windows[1] <= machines) & (windows[2] >= machines))
                if active.size:
                    value = np.maximum(np.take(before, prefix[active]),
                                       _alone(last, fits, pair[active], machines))
                    if crossed:
                        left, right = crossing.advance(machines, flat_running, active)
                        np.minimum(value, np.minimum(left, right), out=value)
                    owner = group_of[active]
                    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
                    where = groups[owner[starts]]
                    row[where] = np.minimum(row[where], np.minimum.reduceat(value, starts))
        if fewer and machines > 1:
            np.minimum(row, table[machines - 1], out=row)
        if keep is not None:
            keep(machines, row)
        if bound < np.inf:
            row[row > bound] = np.inf
        table[machines] = row
        np.minimum(running[:, machines - 1], row, out=running[:, machines])
        if progress is not None:
            progress(machines)
    return table, np.ascontiguousarray(running.T)


def _alone(last: Cost, fits, pairs: np.ndarray, machines: int) -> np.ndarray:
    """The last stage on one replica."""
    ones = np.ones(pairs.size, dtype=np.int64)
    value = last(pairs, ones, machines)
    if fits is not None:
        value[~fits(pairs, ones, machines)] = np.inf
    return value


def best_split(table: np.ndarray, running: np.ndarray, prefix: np.ndarray, pairs: np.ndarray,
               machines: int, last: Cost, replicate: bool = True) -> tuple[float, int, int]:
    """The first best last stage of ``A[machines]`` among candidate cuts (in the order given).

    ``prefix[i]`` is the flat (row, k) index of candidate ``i``'s prefix, ``pairs[i]`` its last
    stage. Returns (value, candidate, replicas): the smallest ``max(A[M - m][prefix], last(m))``,
    the first candidate reaching it, and its fewest replicas that do. The min over ``m >= 2`` per
    candidate is the crossing of :func:`solve_table`, found by binary search.
    """
    width = table.shape[1]
    flat_running = running.ravel()
    value = np.maximum(table[machines - 1][prefix],
                       last(pairs, np.ones(pairs.size, dtype=np.int64), machines))
    if replicate and machines >= 3:
        lo = np.ones(pairs.size, dtype=np.int64)
        hi = np.full(pairs.size, machines - 1, dtype=np.int64)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                break
            mid = (lo[open_] + hi[open_]) >> 1
            crossed = flat_running[mid * width + prefix[open_]] <= \
                last(pairs[open_], machines - mid, machines)
            hi[open_] = np.where(crossed, mid, hi[open_])
            lo[open_] = np.where(crossed, lo[open_], mid + 1)
        left = flat_running[(lo - 1) * width + prefix]
        right = last(pairs, machines - np.minimum(lo, machines - 2), machines)
        right[lo > machines - 2] = np.inf
        np.minimum(value, np.minimum(left, right), out=value)
    best = float(value.min())
    pick = int(np.flatnonzero(value == best)[0])
    replicas = np.arange(1, machines if replicate else 2, dtype=np.int64)
    options = np.maximum(table[machines - replicas, prefix[pick]],
                         last(np.full(replicas.size, pairs[pick]), replicas, machines))
    return best, pick, int(replicas[int(np.argmin(options))])
