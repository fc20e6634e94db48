"""Machine-count windows and bands, against brute force on small cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan.window import (fewest, nested_ranges, prefix_fewest, suffix_fewest,
                                   threshold, upper_bound)


def chain_pairs(states: int):
    """Last stages k -> j (k >= 1) of a chain, grouped by j as build_ranges numbers them."""
    pairs = [(k, j) for j in range(states) for k in range(1, j)]
    return (np.array([k for k, _ in pairs], dtype=np.int64),
            np.array([j for _, j in pairs], dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=6,
                                max_size=6), min_size=1, max_size=5),
       bound=st.sampled_from([0.5, 1.0, 2.0, 2.5]), replicate=st.booleans())
def test_fewest_is_the_first_count_within_the_bound(values, bound, replicate):
    n = 6
    # cost[item, m - 1]: anything at m = 1, non-increasing after
    table = np.array([[v[0]] + sorted(v[1:], reverse=True) for v in values])

    def cost(items, m):
        return table[items, np.asarray(m) - 1]

    any_, two = fewest(cost, len(values), n, bound, replicate)
    for item, row in enumerate(table):
        counts = [m for m in range(1, n + 1) if row[m - 1] <= bound and (replicate or m == 1)]
        assert any_[item] == (counts[0] if counts else math.inf)
        twos = [m for m in counts if m >= 2]
        assert two[item] == (twos[0] if twos else math.inf)


def plans(states: int):
    """Every way to cut a chain of ``states - 1`` layers: lists of cuts 0 = c0 < ... = end."""
    inner = range(1, states - 1)
    for size in range(len(inner) + 1):
        for cut in itertools.combinations(inner, size):
            yield (0,) + cut + (states - 1,)


@settings(max_examples=60, deadline=None)
@given(states=st.integers(2, 6), seed=st.integers(0, 1000))
def test_prefix_and_suffix_fewest_by_brute_force(states, seed):
    rng = np.random.default_rng(seed)
    k, j = chain_pairs(states)
    replicas = rng.choice([1.0, 2.0, 3.0, math.inf], k.size)
    first = rng.choice([1.0, 2.0, 4.0, math.inf], states)
    first[0] = math.inf
    need = {(int(a), int(b)): r for a, b, r in zip(k, j, replicas)}
    lo = prefix_fewest(k, j, first, replicas)
    g = suffix_fewest(k, j, states, replicas)
    for end in range(1, states):
        best = math.inf
        for cuts in plans(end + 1):
            best = min(best, first[cuts[1]] + sum(need[(a, b)] for a, b in zip(cuts[1:],
                                                                            cuts[2:])))
        assert lo[end] == best
    for start in range(1, states):
        best = 0.0 if start == states - 1 else math.inf
        for cuts in plans(states):
            if start in cuts[1:-1]:
                tail = cuts[cuts.index(start):]
                best = min(best, sum(need[(a, b)] for a, b in zip(tail, tail[1:])))
        assert g[start] == best


@settings(max_examples=40, deadline=None)
@given(states=st.integers(2, 5), seed=st.integers(0, 1000), n=st.integers(1, 8))
def test_threshold_counts_are_all_feasible(states, seed, n):
    """Every machine count from L[end] on can run the whole chain within the bound: checked
    by building exact counts from the same per-stage rules."""
    rng = np.random.default_rng(seed)
    k, j = chain_pairs(states)
    two = rng.choice([2.0, 3.0, math.inf], k.size)
    alone = rng.random(k.size) < 0.5
    first_two = rng.choice([2.0, 3.0, math.inf], states)
    first_one = rng.random(states) < 0.5
    first = np.where(first_one, 1.0, first_two)
    replicas = np.where(alone, 1.0, two)
    lo = prefix_fewest(k, j, first, replicas)
    limit = threshold(k, j, lo, two, alone, first_two)
    # exact sets of machine counts up to n + 3
    top = n + 3
    exact = [set() for _ in range(states)]
    for end in range(1, states):
        counts = {m for m in range(1, top + 1)
                  if (m == 1 and first_one[end]) or m >= first_two[end]}
        for p in np.flatnonzero(j == end):
            for before in exact[k[p]]:
                for m in range(1, top + 1):
                    if (m == 1 and alone[p]) or m >= two[p]:
                        if before + m <= top:
                            counts.add(before + m)
        exact[end] = counts
    for end in range(1, states):
        if math.isfinite(limit[end]):
            assert set(range(int(limit[end]), top + 1)) <= exact[end]


def test_upper_bound_bisects_to_the_first_feasible_time():
    assert upper_bound(lambda t: t >= 3.0, 1.0, 10.0, tolerance=1e-6) >= 3.0
    assert upper_bound(lambda t: t >= 3.0, 1.0, 10.0, tolerance=1e-6) <= 3.0 * (1 + 1e-6)
    assert upper_bound(lambda t: True, 0.0, 5.0) == 5.0        # no lower bound: as given


@settings(max_examples=40, deadline=None)
@given(states=st.integers(2, 7), seed=st.integers(0, 1000), prefixes=st.booleans())
def test_nested_ranges_of_a_chain_and_of_the_same_as_a_dag(states, seed, prefixes):
    rng = np.random.default_rng(seed)
    ancestors = np.triu(np.ones((states, states), dtype=bool), 1)
    useful = ancestors & (rng.random((states, states)) < 0.2)
    want = np.zeros_like(useful)
    for r, j2 in zip(*np.nonzero(useful)):
        for a in range(r, states):
            for b in range(a + 1, j2 + 1):
                if not prefixes or a == r:
                    want[a, b] = True
    assert np.array_equal(nested_ranges(useful, ancestors, True, prefixes), want)
    assert np.array_equal(nested_ranges(useful, ancestors, False, prefixes), want)
