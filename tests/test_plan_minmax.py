"""The (min, max) product kernels against plain loops."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrain.plan.minmax import (is_monotone, minmax_band, minmax_dense, minmax_hybrid,
                                   minmax_monotone, monotone_limit)


def brute(a, starts, c):
    rows, n = a.shape
    out = np.full((rows, n), np.inf)
    for p in range(rows):
        for j in range(n):
            for k in range(starts[p] + 1, j):
                out[p, j] = min(out[p, j], max(a[p, k], c[k, j]))
    return out


def monotone_cost(rng, n):
    # c[k, j] = W_j - W_k for non-decreasing W: non-increasing in k
    w = np.cumsum(rng.uniform(0, 1, n))
    c = w[None, :] - w[:, None]
    c[np.tril_indices(n)] = np.inf
    c[0] = np.inf
    return c


@pytest.mark.parametrize("seed", range(6))
def test_monotone_kernel(seed):
    rng = np.random.default_rng(seed)
    n = 40
    c = monotone_cost(rng, n)
    assert is_monotone(c)
    starts = np.arange(n - 1)
    a = rng.uniform(0, 10, (n - 1, n))
    a[rng.uniform(size=a.shape) < 0.1] = np.inf
    for p, r in enumerate(starts):
        a[p, :r + 1] = np.inf
    got = minmax_monotone(a, starts, lambda p, k, j: c[k, j])
    assert np.array_equal(got, brute(a, starts, c))
    dense = minmax_dense(a, c)
    finite = np.isfinite(dense)
    assert np.array_equal(got[finite], dense[finite])


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_kernel_with_rising_tail(seed):
    rng = np.random.default_rng(seed)
    n = 35
    c = monotone_cost(rng, n)
    # the last few cuts before j get expensive (short ranges forced onto many machines)
    for j in range(n):
        for k in range(max(1, j - 4), j):
            c[k, j] += rng.uniform(0, 20)
    assert not is_monotone(c)
    limit = monotone_limit(c)
    for j in range(2, n):
        col = c[1:limit[j] + 1, j]
        assert np.all(np.diff(col) <= 0)
    starts = np.array([0, 3, 10])
    a = rng.uniform(0, 30, (3, n))
    for p, r in enumerate(starts):
        a[p, :r + 1] = np.inf
    got = minmax_hybrid(a, starts, lambda p, k, j: c[k, j], limit)
    assert np.array_equal(got, brute(a, starts, c))


def test_per_problem_costs():
    rng = np.random.default_rng(7)
    n = 20
    costs = [monotone_cost(rng, n) for _ in range(3)]
    stacked = np.stack(costs)
    a = rng.uniform(0, 10, (3, n))
    a[:, 0] = np.inf
    got = minmax_monotone(a, np.zeros(3, dtype=np.int64), lambda p, k, j: stacked[p, k, j])
    for p in range(3):
        assert np.array_equal(got[p], brute(a[p:p + 1], np.array([0]), costs[p])[0])


def brute_band(a, starts, c, stops, first):
    rows, n = a.shape
    out = np.full((rows, n), np.inf)
    for p in range(rows):
        for j in range(starts[p] + 2, stops[p] + 1):
            for k in range(max(starts[p] + 1, first[j]), j):
                out[p, j] = min(out[p, j], max(a[p, k], c[k, j]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_banded_kernels_equal_brute_force_inside_the_band(seed):
    rng = np.random.default_rng(seed)
    n = 45
    c = monotone_cost(rng, n)
    depth = int(rng.integers(3, 12))
    first = np.maximum(np.arange(n) - depth, 0)       # ranges longer than depth are out
    for j in range(n):
        c[:first[j], j] = np.inf
    starts = np.arange(n - 1)
    stops = np.minimum(starts + depth, n - 1)
    a = rng.uniform(0, 10, (n - 1, n))
    for p, r in enumerate(starts):
        a[p, :r + 1] = np.inf
    expected = brute_band(a, starts, c, stops, first)
    got = minmax_monotone(a, starts, lambda p, k, j: c[k, j], stops=stops, first=first)
    assert np.array_equal(got, expected)
    assert np.array_equal(got, brute_band(a, starts, c, stops, np.zeros(n, dtype=int)))
    # a rising tail next to j, tried exhaustively
    for j in range(n):
        for k in range(max(1, j - 3), j):
            c[k, j] += rng.uniform(0, 20)
    limit = monotone_limit(c)
    got = minmax_hybrid(a, starts, lambda p, k, j: c[k, j], limit, stops=stops, first=first)
    assert np.array_equal(got, brute_band(a, starts, c, stops, first))
    # one row from cut 0 (the last level), a column band only
    row = rng.uniform(0, 10, (3, n))
    row[:, 0] = np.inf
    zero = np.zeros(3, dtype=np.int64)
    got = minmax_hybrid(row, zero, lambda p, k, j: c[k, j], limit, first=first)
    assert np.array_equal(got, brute_band(row, zero, c, np.full(3, n - 1), first))


@pytest.mark.parametrize("seed", range(4))
def test_band_kernel_tries_every_cut_for_any_cost(seed):
    rng = np.random.default_rng(seed)
    n, depth = 30, 9
    c = rng.uniform(0, 10, (n, n))                  # no monotonicity at all
    c[rng.uniform(size=c.shape) < 0.2] = np.inf
    a = rng.uniform(0, 10, (n, n))
    rows = np.arange(n)
    # band layouts: a_band[r, e] = a[r, r + e], c_band[k, d] = c[k, k + d]
    a_band = np.full((n, depth), np.inf)
    c_band = np.full((n + depth, depth), np.inf)
    for r in rows:
        for e in range(depth):
            if r + e < n:
                a_band[r, e] = a[r, r + e]
                c_band[r, e] = c[r, r + e]
    got = minmax_band(a_band, c_band)
    for r in rows:
        for d in range(depth):
            j = r + d
            expected = min((max(a[r, k], c[k, j]) for k in range(r + 1, j) if j < n),
                           default=np.inf)
            assert got[r, d] == expected
    with pytest.raises(ValueError, match="rows \\+ depth - 1 rows"):
        minmax_band(a_band, c_band[:n])
