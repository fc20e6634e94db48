"""Machine-count windows: the entries of the last level's table a plan within a time can use.

With many machines most of the table ``A[M][0 -> j]`` is of no use: a prefix ``0 -> j`` cannot
run within a time ``U`` on fewer than ``lo(j)`` machines, and if the rest ``j -> end`` needs at
least ``g(j)`` machines within ``U``, no plan of ``n`` machines within ``U`` gives it more than
``n - g(j)``. Given a plan no slower than ``U`` (found here by bisection on ``U``, see
:func:`upper_bound`), the sweep only fills entries inside ``lo(j) <= M <= n - g(j)`` and only
visits a last stage ``k -> j`` from ``lo(k) + fewest replicas within U`` on; every entry a
traceback of the optimum reads lies inside (its options are no slower than the optimum, so
within ``U``). How wide the windows are depends on how much slack the best plans leave; with
PipeDream's cost model, where every stage gets faster with replicas, it is a few machines.

Costs are callables ``cost(items, m)`` that do not grow with ``m >= 2`` (see
:mod:`pipetrain.plan.sweep`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["fewest", "prefix_fewest", "suffix_fewest", "threshold", "upper_bound", "nested_ranges"]

Cost = Callable[[np.ndarray, np.ndarray], np.ndarray]


def fewest(cost: Cost, size: int, n: int, bound: float, replicate: bool = True
           ) -> tuple[np.ndarray, np.ndarray]:
    """Per item: the fewest ``m`` in ``1..n`` with ``cost <= bound``, and the fewest such
    ``m >= 2`` (floats, ``inf`` for none), by one binary search over ``m`` for all items."""
    items = np.arange(size)
    one = cost(items, np.ones(size, dtype=np.int64)) <= bound
    two = np.full(size, np.inf)
    if replicate and n >= 2 and size:
        fits = np.flatnonzero(cost(items, np.full(size, n, dtype=np.int64)) <= bound)
        lo = np.full(fits.size, 2, dtype=np.int64)
        hi = np.full(fits.size, n, dtype=np.int64)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                break
            mid = (lo[open_] + hi[open_]) >> 1
            ok = cost(fits[open_], mid) <= bound
            hi[open_] = np.where(ok, mid, hi[open_])
            lo[open_] = np.where(ok, lo[open_], mid + 1)
        two[fits] = lo
    return np.where(one, 1.0, two), two


def prefix_fewest(pair_k: np.ndarray, pair_j: np.ndarray, first: np.ndarray,
                  replicas: np.ndarray) -> np.ndarray:
    """``lo[j]``: the fewest machines ``0 -> j`` runs on within the bound.

    ``first[j]``: the fewest for one stage ``0 -> j``; ``replicas[p]``: the fewest for the last
    stage of pair ``p``. Pairs are grouped by ``j`` (as :func:`~pipetrain.plan.sweep.build_ranges`
    numbers them) and cuts are in topological order.
    """
    lo = np.array(first, dtype=np.float64)
    lo[0] = np.inf
    heads = np.flatnonzero(np.r_[True, pair_j[1:] != pair_j[:-1]]) if pair_j.size else pair_j
    ends = np.r_[heads[1:], pair_j.size]
    for head, end in zip(heads, ends):
        j = pair_j[head]
        lo[j] = min(lo[j], float(np.min(lo[pair_k[head:end]] + replicas[head:end])))
    return lo


def suffix_fewest(pair_k: np.ndarray, pair_j: np.ndarray, states: int,
                  replicas: np.ndarray) -> np.ndarray:
    """``g[k]``: the fewest machines the stages from cut ``k`` to the end run on within the
    bound (0 at the end)."""
    g = np.full(states, np.inf)
    g[states - 1] = 0.0
    order = np.argsort(pair_k, kind="stable")
    k_sorted = pair_k[order]
    heads = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]]) if order.size else order
    ends = np.r_[heads[1:], order.size]
    for head, end in zip(heads[::-1], ends[::-1]):
        chosen = order[head:end]
        k = pair_k[chosen[0]]
        g[k] = min(g[k], float(np.min(g[pair_j[chosen]] + replicas[chosen])))
    return g


def threshold(pair_k: np.ndarray, pair_j: np.ndarray, lo: np.ndarray, two: np.ndarray,
              alone: np.ndarray, first_two: np.ndarray) -> np.ndarray:
    """``L[j]``: every machine count from ``L[j]`` on runs ``0 -> j`` within the bound.

    True because a replicated stage only gets faster with more replicas: one stage on any
    ``M >= first_two[j]``; the prefix on ``lo[k]`` machines and a last stage on any
    ``m >= two[p]``; or, where one replica fits (``alone[p]``), the prefix on any count from
    ``L[k]`` and one more machine.
    """
    limit = np.array(first_two, dtype=np.float64)
    limit[0] = np.inf
    heads = np.flatnonzero(np.r_[True, pair_j[1:] != pair_j[:-1]]) if pair_j.size else pair_j
    ends = np.r_[heads[1:], pair_j.size]
    for head, end in zip(heads, ends):
        j = pair_j[head]
        k = pair_k[head:end]
        best = float(np.min(lo[k] + two[head:end]))
        ones = alone[head:end]
        if ones.any():
            best = min(best, float(np.min(limit[k[ones]])) + 1.0)
        limit[j] = min(limit[j], best)
    return limit


def upper_bound(feasible: Callable[[float], bool], low: float, high: float,
                tolerance: float = 1e-2, steps: int = 40) -> float:
    """The smallest time found feasible by geometric bisection between ``low`` (a lower bound)
    and ``high`` (feasible), to ``tolerance`` relative; ``high`` itself if nothing smaller."""
    if not (0 < low < high and np.isfinite(high)):
        return high
    for _ in range(steps):
        if high <= low * (1 + tolerance):
            break
        mid = float(np.sqrt(low * high))
        if feasible(mid):
            high = mid
        else:
            low = mid
    return high


def nested_ranges(useful: np.ndarray, ancestors: np.ndarray, chain: bool,
                  prefixes: bool = False) -> np.ndarray:
    """``out[k, j]``: ``k -> j`` is a stage lying inside some ``useful[r, j2]`` (``r`` a subset
    of ``k``, ``j`` of ``j2``), ``useful`` included; with ``prefixes``, only those starting at
    ``r`` itself."""
    if chain:
        # j2 >= j: a running "any" from the right; then r <= k: a running "any" downwards
        later = np.logical_or.accumulate(useful[:, ::-1], axis=1)[:, ::-1]
        if prefixes:
            return later & ancestors
        return np.logical_or.accumulate(later, axis=0) & ancestors
    states = ancestors.shape[0]
    within = ancestors | np.eye(states, dtype=bool)       # within[a, b]: a is a subset of b
    packed = np.packbits(within.T, axis=1)                # row j2: the cuts j inside j2
    ends = np.zeros_like(packed)                          # row r: the j inside a useful j2
    for r in np.flatnonzero(useful.any(axis=1)):
        ends[r] = np.bitwise_or.reduce(packed[useful[r]], axis=0)
    if prefixes:
        return np.unpackbits(ends, axis=1, count=states).astype(bool) & ancestors
    out = np.zeros_like(packed)
    for k in range(states):                               # OR over every r inside k
        out[k] = np.bitwise_or.reduce(ends[within[:, k]], axis=0)
    return np.unpackbits(out, axis=1, count=states).astype(bool) & ancestors
