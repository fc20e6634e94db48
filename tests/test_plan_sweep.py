"""The machine-count sweep against the recurrence written out with plain loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrain.plan.graph import build_cuts
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.sweep import best_split, build_ranges, solve_table


def residual_ancestors(blocks: int) -> np.ndarray:
    """The cut relation of a small residual network (two layers and an add per block)."""
    layers, edges, before = [LayerProfile("input", input=True)], [], "input"
    for b in range(blocks):
        names = [f"{b}a", f"{b}b", f"{b}add"]
        layers += [LayerProfile(name, forward_s=1e-3, activation_bytes=1.0) for name in names]
        edges += [(before, names[0]), (names[0], names[1]), (names[1], names[2]),
                  (before, names[2])]
        before = names[2]
    return build_cuts(Profile(layers, edges=edges)).ancestors


class Problem:
    """Random costs with the shape the sweep relies on: a last stage that does not get slower
    with replicas from 2 on (any value at 1) and, optionally, a memory-like limit that only
    loosens with replicas and machine counts."""

    def __init__(self, seed: int, states: int, n: int, dag: bool, limited: bool):
        rng = np.random.default_rng(seed)
        self.ancestors = residual_ancestors(max(1, (states - 1) // 3)) if dag else \
            np.triu(np.ones((states, states), dtype=bool), 1)
        self.states = self.ancestors.shape[0]
        self.n = n
        s = self.states
        self.first_cost = np.where(self.ancestors[None, :, :],
                                   rng.choice([0.5, 1.0, 2.0, 3.0, 4.0], (n + 1, s, s)), np.inf)
        # last[k, j, m]: m = 1 anything, then non-increasing (ties on purpose: small values)
        steps = rng.choice([0.0, 0.0, 0.5, 1.0], (s, s, n + 1))
        start = rng.choice([2.0, 4.0, 6.0, 8.0], (s, s))
        self.last_cost = np.maximum(start[:, :, None] - np.cumsum(steps, axis=2), 0.5)
        self.last_cost[:, :, 1] = rng.choice([1.0, 3.0, 9.0], (s, s))
        self.room = rng.integers(0, 3, (s, s)) if limited else None

    def fits(self, k, j, m, machines):
        # a pair fits once m replicas cover the machines after it up to its room
        return (machines - m) <= self.room[k, j] * m

    def sweep(self, rows, fewer: bool, replicate: bool):
        ranges = build_ranges(self.ancestors, np.asarray(rows))
        width = len(rows) * self.states
        rows_arr = np.asarray(rows)

        def first(machines):
            if not replicate and machines > 1:
                return np.full(width, np.inf)
            return self.first_cost[machines][rows_arr].ravel()

        def last(p, m, machines):
            return self.last_cost[ranges.pair_k[p], ranges.pair_j[p], np.asarray(m)]

        fits = None
        if self.room is not None:
            def fits(p, m, machines):
                return self.fits(ranges.pair_k[p], ranges.pair_j[p], np.asarray(m), machines)

        table, running = solve_table(self.n, ranges, first, last, replicate=replicate,
                                     fewer=fewer, static=True, fits=fits)
        return ranges, table.reshape(self.n + 1, len(rows), self.states), running, last, fits

    def loops(self, rows, fewer: bool, replicate: bool):
        """The recurrence with every (k, m) tried."""
        s = self.states
        table = np.full((self.n + 1, len(rows), s), np.inf)
        for machines in range(1, self.n + 1):
            for i, r in enumerate(rows):
                for j in range(s):
                    if not self.ancestors[r, j]:
                        continue
                    best = self.first_cost[machines, r, j] if replicate or machines == 1 \
                        else math.inf
                    if fewer and machines > 1:
                        best = min(best, table[machines - 1, i, j])
                    for k in range(1, s):
                        if not (self.ancestors[r, k] and self.ancestors[k, j]):
                            continue
                        for m in range(1, machines if replicate else min(machines, 2)):
                            cost = self.last_cost[k, j, m]
                            if self.room is not None and not self.fits(k, j, m, machines):
                                cost = math.inf
                            best = min(best, max(table[machines - m, i, k], cost))
                    table[machines, i, j] = best
        return table


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), states=st.integers(2, 9), n=st.integers(1, 9),
       dag=st.booleans(), limited=st.booleans(), fewer=st.booleans(),
       replicate=st.booleans(), inner=st.booleans())
def test_sweep_equals_the_recurrence(seed, states, n, dag, limited, fewer, replicate, inner):
    problem = Problem(seed, states, n, dag, limited)
    rows = list(range(problem.states - 1)) if inner else [0]
    _, table, _, _, _ = problem.sweep(rows, fewer, replicate)
    expected = problem.loops(rows, fewer, replicate)
    assert np.array_equal(table, expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), states=st.integers(3, 8), n=st.integers(2, 9),
       dag=st.booleans(), limited=st.booleans(), replicate=st.booleans())
def test_best_split_is_the_first_minimum(seed, states, n, dag, limited, replicate):
    """The traceback's choice: the earliest cut, then the fewest replicas, among the best."""
    problem = Problem(seed, states, n, dag, limited)
    ranges, table, running, last, fits = problem.sweep([0], False, replicate)
    flat = table.reshape(n + 1, -1)

    def cost(p, m, machines):
        value = np.asarray(last(p, m, machines), dtype=np.float64).copy()
        if fits is not None:
            value[~fits(p, m, machines)] = np.inf
        return value

    end = problem.states - 1
    for machines in range(2, n + 1):
        ks = np.flatnonzero(problem.ancestors[0] & problem.ancestors[:, end])
        ks = ks[ks >= 1]
        if not ks.size:
            continue
        pairs = ranges.pair_id[ks, end]
        value, pick, m = best_split(flat, running, ks, pairs, machines, cost, replicate)
        grid = [(max(flat[machines - mm, k], float(cost(np.array([p]), np.array([mm]),
                                                         machines)[0])), i, mm)
                for i, (k, p) in enumerate(zip(ks, pairs))
                for mm in range(1, machines if replicate else 2)]
        best = min(g[0] for g in grid)
        assert value == best
        if math.isfinite(best):
            assert (pick, m) == next((i, mm) for v, i, mm in grid if v == best)


def test_ranges_of_a_band():
    ancestors = np.triu(np.ones((6, 6), dtype=bool), 1)
    band = ancestors & (np.arange(6)[None, :] - np.arange(6)[:, None] <= 2)
    ranges = build_ranges(ancestors, np.arange(5), band, band[:5])
    assert all(band[k, j] for k, j in zip(ranges.pair_k, ranges.pair_j))
    triples = {(int(ranges.rows[r]), int(ranges.pair_k[p]), int(ranges.pair_j[p]))
               for r, p in zip(ranges.row, ranges.pair)}
    assert triples == {(r, k, j) for r in range(5) for k in range(r + 1, 6)
                       for j in range(k + 1, 6) if j - r <= 2}


@pytest.mark.parametrize("states", [1, 2])
def test_tiny_tables(states):
    problem = Problem(0, states, 3, False, False)
    _, table, _, _, _ = problem.sweep([0], False, True)
    assert np.array_equal(table, problem.loops([0], False, True))
