"""The (min, max) product at the heart of the partitioning DP.

``ans[r, j] = min over k of max(a[r, k], c[k, j])``: the best pipeline from cut ``r`` to cut ``j``
whose last stage starts at cut ``k``, where ``a`` prices the pipeline up to ``k`` and ``c`` the
last stage. Two exact kernels:

* :func:`minmax_dense` tries every ``k`` (chunked over rows to bound memory).
* :func:`minmax_monotone` needs ``c[k, j]`` non-increasing in ``k`` (a shorter last stage is no
  slower), which holds for chains. Then ``min_k max(a[k], c[k]) = min_k max(c[k], s[k])`` with
  ``s[k] = min(a[k..j-1])``: ``c`` falls and ``s`` rises with ``k``, so the minimum sits where they
  cross, found by binary search with a sparse table for the range minima. ``O(log n)`` per entry
  instead of ``O(n)``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["minmax_dense", "minmax_monotone", "is_monotone"]

_CHUNK = 1 << 21  # elements per temporary block


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


def is_monotone(c: np.ndarray) -> bool:
    """True if every column of the upper triangle ``c[1:j, j]`` is non-increasing in ``k``."""
    n = c.shape[0]
    if n < 3:
        return True
    d = c[2:, :] - c[1:-1, :]           # c[k+1, j] - c[k, j] for k = 1..n-2
    k = np.arange(1, n - 1)[:, None]
    j = np.arange(c.shape[1])[None, :]
    region = (k + 1) < j                # both k and k+1 are valid splits of column j
    bad = region & ~(d <= 0)
    # inf - inf (both not allowed) is fine; inf after a finite value is not
    both_inf = np.isinf(c[2:, :]) & np.isinf(c[1:-1, :])
    return not (bad & ~both_inf).any()


def minmax_monotone(a: np.ndarray, cost: Callable[[np.ndarray, np.ndarray], np.ndarray],
                    rows: np.ndarray) -> np.ndarray:
    """Chain version: ``ans[i, j] = min over rows[i] < k < j of max(a[i, k], cost(k, j))``.

    ``cost(k, j)`` (evaluated on index arrays) must be non-increasing in ``k`` on ``1 <= k < j``
    (see :func:`is_monotone`); it is evaluated only where the search looks.
    """
    n_rows, n = a.shape
    out = np.full((n_rows, n), np.inf)
    levels = max(1, int(n).bit_length())
    log2 = np.zeros(n + 1, dtype=np.int64)
    for length in range(2, n + 1):
        log2[length] = log2[length // 2] + 1
    step = max(1, (1 << 22) // (levels * n))
    for start in range(0, n_rows, step):
        a_blk = a[start:start + step]
        nb = a_blk.shape[0]
        table = np.empty((levels, nb, n))
        table[0] = a_blk
        for lv in range(1, levels):
            half = 1 << (lv - 1)
            table[lv] = table[lv - 1]
            np.minimum(table[lv - 1][:, :n - half], table[lv - 1][:, half:],
                       out=table[lv][:, :n - half])
        flat = table.ravel()
        r = rows[start:start + nb]
        ii, jj = np.nonzero(np.arange(n)[None, :] >= r[:, None] + 2)
        if ii.size == 0:
            continue
        rr = r[ii]
        base_row = ii * n

        def range_min(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
            lv = log2[hi - lo + 1]
            off = lv * (nb * n) + base_row
            return np.minimum(flat[off + lo], flat[off + hi - (1 << lv) + 1])

        lo = rr + 1
        hi = jj.copy()
        for _ in range(levels + 1):
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) >> 1
            mid = np.minimum(mid, jj - 1)
            pred = range_min(mid, jj - 1) >= cost(mid, jj)
            hi = np.where(active & pred, mid, hi)
            lo = np.where(active & ~pred, mid + 1, lo)
        kstar = lo
        left = kstar - 1
        v1 = np.where(left >= rr + 1, cost(np.maximum(left, 1), jj), np.inf)
        safe = np.minimum(kstar, jj - 1)
        v2 = np.where(kstar <= jj - 1, range_min(safe, jj - 1), np.inf)
        out[start + ii, jj] = np.minimum(v1, v2)
    return out
