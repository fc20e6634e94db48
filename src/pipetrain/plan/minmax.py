"""The (min, max) product at the heart of the partitioning DP.

``ans[p, j] = min over k of max(a[p, k], c(p, k, j))``: the best pipeline ending at cut ``j``
whose last stage starts at cut ``k``, where ``a`` prices the pipeline up to ``k`` and ``c`` the
last stage. Exact kernels:

* :func:`minmax_dense` tries every ``k`` (chunked to bound memory).
* :func:`minmax_monotone` needs ``c`` non-increasing in ``k`` (a shorter last stage is no slower),
  true for chains. Then ``min_k max(a[k], c[k]) = min_k max(c[k], s[k])`` with
  ``s[k] = min(a[k..j-1])``: ``c`` falls and ``s`` rises with ``k``, so the minimum sits where they
  cross, found by binary search with a sparse table for the range minima; ``O(log n)`` per entry.
* :func:`minmax_hybrid` handles a ``c`` that is monotone only up to a column-dependent cut
  ``limit[j]`` (inner levels of a hierarchy with exact machine counts: very short ranges forced
  onto many machines are slow): binary search up to ``limit[j]``, every ``k`` after it.
* :func:`minmax_band` works on band layouts (``a[r, k - r]``, ``c[k, j - k]``) and tries every
  ``k``, any cost: ``O(depth^2)`` per row in contiguous slices, cheaper than the binary search
  while the band is a few hundred cuts deep.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["minmax_dense", "minmax_monotone", "minmax_hybrid", "minmax_band", "is_monotone",
           "monotone_limit"]

_CHUNK = 1 << 21  # elements per temporary block
Cost = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def minmax_dense(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``min_k max(a[r, k], c[k, j])`` for all ``r, j`` (``inf`` entries mean "not allowed")."""
    rows = a.shape[0]
    out = np.full((rows, c.shape[1]), np.inf)
    if a.shape[1] == 0:
        return out
    step = max(1, _CHUNK // max(1, c.size))
    for start in range(0, rows, step):
        block = np.maximum(a[start:start + step, :, None], c[None, :, :])
        out[start:start + step] = block.min(axis=1)
    return out


def minmax_band(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``ans[r, d] = min over 0 < e < d of max(a[r, e], c[r + e, d - e])`` (``inf`` for d < 2).

    Band layouts: ``a[r, e]`` prices the pipeline from row ``r``'s start to ``r + e``, ``c[k, d]``
    the last stage ``k -> k + d``; ``c`` needs ``rows + depth - 1`` rows (pad with ``inf``).
    """
    rows, depth = a.shape
    if c.shape[0] < rows + depth - 1 or c.shape[1] < depth:
        raise ValueError("minmax_band: c needs rows + depth - 1 rows and depth columns")
    out = np.full((rows, depth), np.inf)
    for e in range(1, depth - 1):
        block = np.maximum(a[:, e:e + 1], c[e:e + rows, 1:depth - e])
        np.minimum(out[:, e + 1:], block, out=out[:, e + 1:])
    return out


def is_monotone(c: np.ndarray) -> bool:
    """True if every column of the upper triangle ``c[1:j, j]`` is non-increasing in ``k``."""
    n = c.shape[0]
    if n < 3:
        return True
    with np.errstate(invalid="ignore"):
        d = c[2:, :] - c[1:-1, :]       # c[k+1, j] - c[k, j] for k = 1..n-2
    k = np.arange(1, n - 1)[:, None]
    j = np.arange(c.shape[1])[None, :]
    region = (k + 1) < j                # both k and k+1 are valid splits of column j
    bad = region & ~(d <= 0)
    both_inf = np.isinf(c[2:, :]) & np.isinf(c[1:-1, :])
    return not (bad & ~both_inf).any()


def monotone_limit(c: np.ndarray) -> np.ndarray:
    """``limit[j]``: the largest ``k < j`` with ``c[1..k, j]`` non-increasing (0 for ``j < 2``)."""
    n = c.shape[0]
    limit = np.maximum(np.arange(c.shape[1]) - 1, 0)
    if n < 3:
        return limit
    with np.errstate(invalid="ignore"):
        up = c[2:, :] > c[1:-1, :]      # c[k+1, j] > c[k, j], k = 1..n-2
    k = np.arange(1, n - 1)[:, None]
    up &= (k + 1) < np.arange(c.shape[1])[None, :]
    has = up.any(axis=0)
    first = np.argmax(up, axis=0) + 1   # the k of the first rise
    return np.where(has, first, limit)


def _log2_table(n: int) -> np.ndarray:
    log2 = np.zeros(n + 1, dtype=np.int64)
    for length in range(2, n + 1):
        log2[length] = log2[length // 2] + 1
    return log2


def minmax_monotone(a: np.ndarray, starts: np.ndarray, cost: Cost,
                    limit: np.ndarray | None = None, stops: np.ndarray | None = None,
                    first: np.ndarray | None = None,
                    mask: np.ndarray | None = None) -> np.ndarray:
    """``ans[p, j] = min over starts[p] < k < j of max(a[p, k], cost(p, k, j))``.

    ``cost(p, k, j)`` (evaluated on index arrays, only where the search looks) must be
    non-increasing in ``k`` on ``starts[p] < k < j``; with ``limit``, only ``k <= limit[j]`` is
    searched and only there must it be monotone. Optional bands (entries outside stay ``inf``):
    ``stops[p]``, the last column ``j`` computed for row ``p``; ``first[j]``, the smallest ``k``
    worth trying for column ``j`` (the cost must be ``inf`` below it); ``mask[p, j]``, False
    where the entry is not wanted.
    """
    n_rows, n = a.shape
    out = np.full((n_rows, n), np.inf)
    if n_rows == 0 or n < 3:
        return out
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.full(n_rows, n - 1, dtype=np.int64) if stops is None else \
        np.minimum(np.asarray(stops, dtype=np.int64), n - 1)
    log2 = _log2_table(n)
    span = max(1, int((stops - starts).max()) - 1)   # the most cuts k one row can try
    longest = span if first is None else \
        max(1, min(span, int(np.max(np.arange(n) - first, initial=1))))
    levels = max(1, int(longest).bit_length())       # range minima over at most this many
    step = max(1, (1 << 18) // (levels * span))      # keep the table in cache
    offsets = np.arange(span)

    def block(rows: np.ndarray) -> None:
        # row i's window of k: r_i + 1 .. r_i + span (a band: the table is rows x span)
        r = starts[rows]
        s = stops[rows]
        nb = rows.size
        table = np.empty((levels, nb, span))
        table[0] = a[rows[:, None], np.minimum(r[:, None] + 1 + offsets[None, :], n - 1)]
        for lv in range(1, levels):
            half = 1 << (lv - 1)
            table[lv, :, span - half:] = table[lv - 1, :, span - half:]
            np.minimum(table[lv - 1, :, :span - half], table[lv - 1, :, half:],
                       out=table[lv, :, :span - half])
        flat = table.ravel()
        ii, dj = np.nonzero(offsets[None, :] + r[:, None] + 2 <= s[:, None])
        if ii.size == 0:
            return
        rr = r[ii]
        jj = rr + 2 + dj
        pp = rows[ii]
        base_row = ii * span - rr - 1
        plane = nb * span

        def range_min(lo: np.ndarray, hi: np.ndarray, base: np.ndarray) -> np.ndarray:
            lv = log2[hi - lo + 1]
            off = lv * plane + base
            return np.minimum(flat[off + lo], flat[off + hi - (1 << lv) + 1])

        last = jj - 1 if limit is None else np.minimum(jj - 1, limit[jj])
        low = rr + 1 if first is None else np.maximum(rr + 1, first[jj])
        keep = last >= low
        if mask is not None:
            keep &= mask[pp, jj]
        if not keep.all():
            pp, rr, jj, last, base_row, low = (x[keep] for x in (pp, rr, jj, last, base_row,
                                                                  low))
        # binary search for the first k whose suffix minimum reaches the cost, dropping the
        # entries whose search interval has closed
        lo = low.copy()
        where = np.arange(lo.size)
        a_lo, a_hi, a_last, a_base, a_p, a_j = lo, last + 1, last, base_row, pp, jj
        for _ in range(int(span).bit_length() + 2):
            open_ = a_lo < a_hi
            if not open_.all():
                lo[where[~open_]] = a_lo[~open_]
                where, a_lo, a_hi, a_last, a_base, a_p, a_j = (
                    x[open_] for x in (where, a_lo, a_hi, a_last, a_base, a_p, a_j))
            if where.size == 0:
                break
            mid = (a_lo + a_hi) >> 1
            pred = range_min(mid, a_last, a_base) >= cost(a_p, mid, a_j)
            a_hi = np.where(pred, mid, a_hi)
            a_lo = np.where(pred, a_lo, mid + 1)
        if where.size:
            lo[where] = a_lo
        left = lo - 1
        v1 = np.where(left >= low, cost(pp, np.maximum(left, low), jj), np.inf)
        v2 = np.where(lo <= last, range_min(np.minimum(lo, last), last, base_row), np.inf)
        out[pp, jj] = np.minimum(v1, v2)

    for begin in range(0, n_rows, step):
        block(np.arange(begin, min(begin + step, n_rows)))
    return out


def minmax_hybrid(a: np.ndarray, starts: np.ndarray, cost: Cost,
                  limit: np.ndarray, stops: np.ndarray | None = None,
                  first: np.ndarray | None = None,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """:func:`minmax_monotone` for ``cost`` monotone in ``k`` only up to ``limit[j]``.

    Cuts ``k > limit[j]`` (typically a few next to ``j``) are all tried.
    """
    out = minmax_monotone(a, starts, cost, limit, stops, first, mask)
    n = a.shape[1]
    cols = np.arange(n)[None, :]
    inside = cols >= starts[:, None] + 2
    if stops is not None:
        inside &= cols <= np.asarray(stops)[:, None]
    if mask is not None:
        inside &= mask
    pp, jj = np.nonzero(inside)
    begin = np.maximum(starts[pp] + 1, limit[jj] + 1)
    if first is not None:
        begin = np.maximum(begin, first[jj])
    lengths = jj - begin
    keep = lengths > 0
    pp, jj, begin, lengths = pp[keep], jj[keep], begin[keep], lengths[keep]
    if pp.size == 0:
        return out
    heads = np.cumsum(lengths) - lengths
    owner = np.repeat(np.arange(pp.size), lengths)
    k = begin[owner] + np.arange(owner.size) - heads[owner]
    p_of, j_of = pp[owner], jj[owner]
    values = np.maximum(a[p_of, k], cost(p_of, k, j_of))
    tail = np.minimum.reduceat(values, heads)
    out[pp, jj] = np.minimum(out[pp, jj], tail)
    return out
