"""PipeDream's DP over a whole topology: every level solved inner first, in a band where it can.

A topology of several levels is solved only in the band of stages a plan within a bound can have
(:meth:`Solver._band`), widening the bound until the band's plan is inside it; the plan is traced
back from the tables (:meth:`Solver.stages`). See :mod:`pipetrain.plan.optimizer`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from pipetrain.plan.cost_model import data_parallel_time
from pipetrain.plan.graph import Cuts
from pipetrain.plan.level import WINDOW_MACHINES, Level, MemoryBudget, Problem
from pipetrain.plan.topology import Topology
from pipetrain.plan.window import nested_ranges

__all__ = ["Solver", "BAND_GROWTH", "BAND_PASSES"]

BAND_START = 2.0   # first upper bound on a banded solve: this many times the lower bound
BAND_GROWTH = 1.5  # a banded solve found nothing within its bound: the next bound, this times
BAND_PASSES = 8    # banded solves before the whole table
BAND_JUMP = 0.5    # a band this much of data parallelism's: solve that one (exact) instead


class Solver(Problem):
    """The levels' tables of one :class:`~pipetrain.plan.level.Problem`, solved and traced back."""

    def __init__(self, cuts: Cuts, topology: Topology, model: str, straight: bool,
                 fewer: bool, memory: MemoryBudget) -> None:
        super().__init__(cuts, topology, model, straight, fewer, memory)
        self.levels: list[Level] = []

    def _without_limit(self, cuts, fewer: bool) -> float:
        """The best time per minibatch on ``cuts`` without the memory limit: a memory-limited plan
        is no faster, so machine windows start from it."""
        relaxed = Solver(cuts, self.topology, self.model, self.straight, fewer,
                          dataclasses.replace(self.memory, limit=None))
        relaxed.progress = self.progress
        return relaxed.solve()

    def solve(self) -> float:
        """The best time per minibatch; topologies of several levels are solved in a band."""
        if self.topology.levels == 1:
            if self.memory.limit is None or self.topology.workers < WINDOW_MACHINES:
                return self._solve_levels(None)
            # a memory limit: the plan without it is no slower, so its time is where machine
            # windows start (they never depend on the limit); widen until the plan is inside
            bound = self._without_limit(self.cuts, self.fewer)
            for _ in range(BAND_PASSES):
                if not (math.isfinite(bound) and bound > 0):
                    break
                value = self._solve_levels(None, bound)
                if value <= bound:
                    return value
                bound *= BAND_GROWTH
            return self._solve_levels(None)
        if self.straight and not self.fewer and self.topology.workers > self.cuts.num_states - 1:
            return math.inf                     # fewer layers than workers: no straight plan
        # Every stage of the last level costs at least range_bound() of its range (below). With
        # an upper bound U on the optimum, ranges whose bound exceeds U are in no optimal plan,
        # nor are the ranges that contain them: inner levels solve only the band of shorter
        # ranges. A banded solution no slower than U is the exact optimum (the optimal plan
        # lies inside the band). U starts at BAND_START times a lower bound and grows to the
        # banded solution's time (a plan, so the next pass is exact) or by BAND_GROWTH; after
        # BAND_PASSES tries the whole table is solved. Passes below the optimum are cheap
        # where their bands are narrow; where a band is about as wide as that of plain data
        # parallelism (a plan: one stage at every level), that is solved instead, exactly.
        cap = math.inf
        if not self.straight:
            cap = data_parallel_time(float(self.cuts.compute[-1]), float(self.cuts.params[-1]),
                                     self.topology, self.model)
        capped = None
        bound = BAND_START * self._lower_bound()
        for _ in range(BAND_PASSES):
            if not (math.isfinite(bound) and bound > 0):
                break
            band = self._band(min(bound, cap))
            if bound < cap and math.isfinite(cap):
                capped = self._band(cap) if capped is None else capped
                if self._band_work(band) >= BAND_JUMP * self._band_work(capped):
                    bound, band = cap, capped
            bound = min(bound, cap)
            value = math.inf if band is None else self._solve_levels(band, bound)
            if value <= bound:
                return value
            bound = min(value, BAND_GROWTH * bound)
        return self._solve_levels(None)

    def _band_work(self, band: np.ndarray | None) -> float:
        """About how many (triple, machine count) steps the levels solve in ``band``."""
        if band is None:
            return 0.0
        cuts = self.cuts
        states = np.arange(cuts.num_states)
        inner = np.maximum(states[None, :] - states[:, None] - 1, 0)    # cuts between
        machines = self.topology.machines
        work = machines[-1] * float(inner[0][band[0]].sum() + band[1:].sum())
        if len(machines) > 1:
            prefixes = nested_ranges(band, cuts.ancestors, cuts.chain, prefixes=True)
            work += machines[-2] * float(inner[prefixes].sum())
        if len(machines) > 2:
            nested = nested_ranges(band, cuts.ancestors, cuts.chain)
            work += sum(machines[:-2]) * float(inner[nested].sum())
        return work

    def range_bound(self, k, j):
        """A lower bound on any last-level stage over ``k -> j``: non-decreasing as it grows.

        A pipeline's slowest stage takes at least its compute over its workers, so level
        ``l - 1`` runs a range in at least ``compute / W`` (``W`` workers below the last level);
        a last-level stage on ``m`` replicas costs the least at ``m = 1`` or ``m = n``.
        """
        top, cuts = self.topology, self.cuts
        inner = math.prod(top.machines[:-1])
        seg = (cuts.compute[j] - cuts.compute[k]) / inner
        n, bandwidth, within = top.machines[-1], top.bandwidths[-1], top.machines[-2]
        if self.straight or n == 1:
            return seg
        pseg = cuts.params[j] - cuts.params[k]
        sync = 4 * (n - 1) * pseg / (bandwidth * n)
        if self.model == "paper":
            spread = np.maximum(seg, sync) / n
        else:
            spread = (seg + sync / within) / n   # the one-stage form: the smallest all-reduce
        return np.minimum(seg, spread)

    def _lower_bound(self) -> float:
        """The optimum is at least total compute / workers and every one-layer range's bound."""
        cuts = self.cuts
        last = cuts.num_states - 1
        if cuts.chain:
            k = np.arange(last)
            j = k + 1
        else:                                   # DAGs: the stages of one layer
            size = cuts.members.sum(axis=1)
            k, j = np.nonzero(cuts.ancestors & (size[None, :] - size[:, None] == 1))
        return float(max(cuts.compute[last] / self.topology.workers,
                         np.max(self.range_bound(k, j), initial=0.0)))

    def _band(self, bound: float) -> np.ndarray | None:
        """``band[k, j]``: ``k -> j`` can be a last-level stage of a plan within ``bound``
        (None: no plan is).

        A last-level stage over ``k -> j`` costs at least what it would if the levels below ran
        the range at its compute over their ``W`` workers (no pipeline beats that), and the
        cuts before and after it need machines of their own. Pricing the last level with that
        lower bound (all-reduce, transfers and replica counts as they are) gives the fewest
        machines ``lo(k)`` for ``0 -> k``, ``g(j)`` for ``j -> end`` and ``m(k -> j)`` for the
        stage within ``bound`` (:mod:`pipetrain.plan.window`); a plan within ``bound`` only
        has stages with ``lo(k) + m(k -> j) + g(j) <= n``. The level below solves these ranges
        and their prefixes (its rows start where they start), deeper levels every range
        nested in them (see :meth:`_solve_levels`).
        """
        cuts = self.cuts
        top = self.topology
        inner = math.prod(top.machines[:-1])
        compute = cuts.compute
        probe = Level(self, top.levels - 1, lambda k, j: (compute[j] - compute[k]) / inner)
        lo, g, replicas, first = probe.reach(bound)
        if not lo[-1] <= probe.n:
            return None
        k, j = probe.ranges.pair_k, probe.ranges.pair_j
        useful = np.zeros((cuts.num_states, cuts.num_states), dtype=bool)
        fits = lo[k] + replicas + g[j] <= probe.n
        useful[k[fits], j[fits]] = True
        useful[0] = cuts.ancestors[0] & (first + g <= probe.n)
        return useful

    def _solve_levels(self, band: np.ndarray | None, bound: float | None = None) -> float:
        """Solve every level, inner first; with a band (the last level's possible stages), the
        level below the last solves only the ranges that start where one of them starts and
        end inside it (the prefixes its DP rows need), and deeper levels, which price the
        stages of those rows, every range nested in one of them."""
        cuts = self.cuts
        compute = cuts.compute
        self.levels = []
        top = self.topology.levels - 1
        bands = {}
        if band is not None:
            bands[top] = band
            if top >= 1:
                bands[top - 1] = nested_ranges(band, cuts.ancestors, cuts.chain, prefixes=True)
            if top >= 2:
                nested = nested_ranges(band, cuts.ancestors, cuts.chain)
                bands.update((index, nested) for index in range(top - 1))

        def seg_compute(k, j):
            return compute[j] - compute[k]

        seg: Callable = seg_compute
        for index in range(self.topology.levels):
            level = Level(self, index, seg, bands.get(index), bound)
            level.solve()
            self.levels.append(level)
            if not level.final:
                full = np.full((cuts.num_states, cuts.num_states), np.inf)
                full[level.rows] = level.table[level.n]
                seg = (lambda k, j, full=full: full[k, j])
        last = self.levels[-1]
        return float(last.table[last.n, 0, cuts.num_states - 1])

    def smallest_memory(self) -> float:
        level = self.levels[-1]
        table = level.solve(mode="memory")
        return float(table[level.n, 0, self.cuts.num_states - 1])

    def stages(self) -> list[tuple[int, int, list[tuple[int, str, int, int]]]]:
        """Flattened stages: (start, end, [(replicas, kind, k, j) per level, inner first])."""
        top = len(self.levels) - 1
        return self._expand(top, 0, self.cuts.num_states - 1, self.levels[top].n)

    def _expand(self, index: int, r: int, j: int, machines: int) -> list:
        level = self.levels[index]
        pending: list[tuple[int, int, int, str]] = []
        while True:
            choice = level.choose(r, j, machines)
            if choice[0] == "fewer":
                machines -= 1
                continue
            if choice[0] == "single":
                pending.append((r, j, machines, "single"))
                break
            _, k, m = choice
            pending.append((k, j, m, "split"))
            j, machines = k, machines - m
        out = []
        for start, end, m, kind in reversed(pending):
            if index == 0:
                inner = [(start, end, [])]
            else:
                inner = self._expand(index - 1, start, end, self.levels[index - 1].n)
            for a, b, path in inner:
                out.append((a, b, path + [(m, kind, start, end)]))
        return out
