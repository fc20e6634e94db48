"""One topology level's DP table of PipeDream's optimizer, with the formulas it is built from.

The recurrence and the cost models are in :mod:`pipetrain.plan.optimizer`'s docstring; the levels
are solved inner first by :class:`pipetrain.plan.solver.Solver`, which is a :class:`Problem`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipetrain.errors import PipetrainError
from pipetrain.plan.cost_model import stage_time
from pipetrain.plan.effort import Effort
from pipetrain.plan.graph import Cuts
from pipetrain.plan.stage_memory import stage_memory
from pipetrain.plan.sweep import best_split, build_ranges, solve_table
from pipetrain.plan.topology import Topology
from pipetrain.plan.window import fewest, prefix_fewest, suffix_fewest, threshold, upper_bound

__all__ = ["MemoryBudget", "Problem", "Level", "WINDOW_MACHINES"]

WINDOW_MACHINES = 64  # last levels with this many machines or more are solved in windows


@dataclass
class MemoryBudget:
    """What the memory model of a stage needs (:func:`pipetrain.plan.stage_memory.stage_memory`) and
    the limit it must fit (None: no limit)."""

    limit: float | None
    schedule: str
    microbatches: int
    workers: int
    recompute: bool = False  # a stage that does not fit may recompute its activations


@dataclass
class Problem:
    """What one solve plans, read by every level of its DP: the model's cuts, the topology,
    the cost model and the options."""

    cuts: Cuts
    topology: Topology
    model: str
    straight: bool
    fewer: bool
    memory: MemoryBudget
    progress: bool = False   # show progress of long tables (a bar on a terminal, one line otherwise)


class Level:
    """The DP table of one topology level, with the formulas it was built from.

    Filled by :func:`pipetrain.plan.sweep.solve_table` over the level's (row, k, j) triples: the
    rows are every start cut for an inner level (the next level prices any range by this level's
    best pipeline over it) and only cut 0 for the last level.
    """

    def __init__(self, solver: Problem, index: int, seg: Callable,
                 band: np.ndarray | None = None, bound: float | None = None) -> None:
        self.s = solver
        self.index = index
        self.n = solver.topology.machines[index]
        self.bandwidth = solver.topology.bandwidths[index]
        self.within = solver.topology.machines[index - 1] if index > 0 else 1
        self.final = index == solver.topology.levels - 1
        self.seg = seg
        cuts = solver.cuts
        self.rows = np.array([0]) if self.final else np.arange(cuts.num_states - 1)
        if band is not None and not self.final:
            self.rows = self.rows[band[self.rows].any(axis=1)]      # rows with ranges to solve
        self.row_of = np.full(cuts.num_states, -1, dtype=np.int64)   # cut -> table row
        self.row_of[self.rows] = np.arange(self.rows.size)
        self.memory = solver.memory if (self.final and solver.topology.levels == 1) else None
        # a band: the last level only uses the stages band[k, j], an inner level only solves
        # the ranges band[r, j] (see Solver._band)
        self.band = None if (band is None or self.final) else band[self.rows]
        self.bound = bound if self.final else None
        self.ranges = build_ranges(cuts.ancestors, self.rows, band if self.final else None,
                                   self.band)
        k, j = self.ranges.pair_k, self.ranges.pair_j
        self.pair_seg = np.asarray(seg(k, j), dtype=np.float64)
        self.pair_params = cuts.params[j] - cuts.params[k]
        # bytes in and out of a last stage: both cost 2 bytes / (B m) in pipedream-code (the
        # larger decides); paper: only the input, 2 bytes / B
        out = np.where(j == cuts.num_states - 1, 0.0, cuts.output[j])
        self.pair_transfer = 2.0 * (cuts.output[k] if solver.model == "paper" else
                                    np.maximum(cuts.output[k], out))
        self.table = self.running = None

    def effort(self, windows: tuple[np.ndarray, ...] | None = None) -> Effort:
        """What this level's sweep will cost (:mod:`pipetrain.plan.effort`)."""
        top = self.s.topology
        if windows is None:
            elements = self.n * self.ranges.triples
        else:
            _, start, stop = windows
            elements = int(np.clip(np.minimum(stop, self.n) - np.maximum(start, 2) + 1, 0,
                                   None).sum())
        what = f"{self.n:,} workers" if top.levels == 1 else \
            f"level {self.index + 1} of {top.levels} ({self.n:,} machines)"
        return Effort(self.n, elements, len(self.rows) * self.s.cuts.num_states, what)

    # costs ----------------------------------------------------------------------------------
    def _mem(self, k, j, m, workers_from_here, recompute: bool = False):
        c = self.s.cuts
        return stage_memory(self.memory.schedule, parameter_bytes=c.params[j] - c.params[k],
                            optimizer_bytes=c.optimizer[j] - c.optimizer[k],
                            activation_bytes=c.activations[j] - c.activations[k],
                            workers_from_here=workers_from_here, replicas=m,
                            microbatches=self.memory.microbatches, recompute=recompute,
                            input_bytes=self._input_bytes(k, j) if recompute else 0.0)

    def _least_mem(self, k, j, m, workers_from_here):
        """The memory of stage ``k -> j``: the smaller with and without recomputation, where
        the planner may recompute."""
        plain = self._mem(k, j, m, workers_from_here)
        if not self._recomputing():
            return plain
        return np.minimum(plain, self._mem(k, j, m, workers_from_here, recompute=True))

    def _input_bytes(self, k, j):
        """What crosses the cut into stage ``k -> j``: the input it keeps when it recomputes."""
        return self.s.cuts.output[k]

    def _forward(self, k, j):
        """The forward time of stage ``k -> j``: what recomputation runs once more."""
        forward = self.s.cuts.forward
        return 0.0 if forward is None else forward[j] - forward[k]

    def _limited(self) -> bool:
        return self.memory is not None and self.memory.limit is not None

    def _recomputing(self) -> bool:
        """Whether a stage that does not fit the memory limit may recompute its activations."""
        return self._limited() and self.memory.recompute

    def _within_limit(self, k, j, m, workers_from_here, plain, again):
        """``plain`` where stage ``k -> j`` fits the limit, else ``again`` (its time with
        recomputation) where that fits, else ``inf``."""
        fits = self._mem(k, j, m, workers_from_here) <= self.memory.limit
        if not self._recomputing():
            return np.where(fits, plain, np.inf)
        fits_again = self._mem(k, j, m, workers_from_here, recompute=True) <= self.memory.limit
        return np.where(fits, plain, np.where(fits_again, again(), np.inf))

    def single(self, r, j, m, mode: str = "time", limit: bool = True):
        """One stage ``r -> j`` on ``m`` replicas; ``inf`` where that is no stage (or, with
        ``limit``, where it does not fit the memory limit)."""
        cuts = self.s.cuts
        valid = cuts.ancestors[r, j]
        if mode == "memory":
            return np.where(valid, self._least_mem(r, j, m, self.memory.workers), np.inf)

        def time(extra=0.0):
            return stage_time(self.s.model, self.seg(r, j) + extra, cuts.params[j] - cuts.params[r], m,
                               self.bandwidth, self.within, single=True)

        value = time()
        if limit and self._limited():
            value = self._within_limit(r, j, m, self.memory.workers, value,
                                       lambda: time(self._forward(r, j)))
        return np.where(valid, value, np.inf)

    def last(self, p, m, machines: int, mode: str = "time"):
        """Last stage (pair ``p``) of a ``machines``-machine pipeline on ``m`` replicas: its
        input transfer, compute and all-reduce, and output transfer unless it ends the model
        (``inf`` where it does not fit the memory limit)."""
        if mode == "memory":
            k, j = self.ranges.pair_k[p], self.ranges.pair_j[p]
            return self._least_mem(k, j, m, self.memory.workers - machines + m)
        value = self.last_time(p, m)
        if self._recomputing():
            value = np.where(self.fits(p, m, machines, "plain"), value,
                             np.where(self.fits(p, m, machines, "again"), self.last_time(p, m, again=True),
                                      np.inf))
        elif self._limited():
            value = np.where(self.fits(p, m, machines), value, np.inf)
        return value

    def last_time(self, p, m, again: bool = False):
        """:meth:`last` without the memory limit (it does not depend on the machine count);
        ``again``: with the stage's forward once more (recomputation)."""
        seg = self.pair_seg[p]
        if again:
            if not hasattr(self, "_pair_forward"):
                self._pair_forward = np.asarray(self._forward(self.ranges.pair_k, self.ranges.pair_j),
                                                dtype=np.float64) * np.ones(self.ranges.pair_k.size)
            seg = seg + self._pair_forward[p]
        value = stage_time(self.s.model, seg, self.pair_params[p], m,
                            self.bandwidth)
        transfer = self.pair_transfer[p]
        if self.s.model == "paper":
            return np.maximum(value, transfer / self.bandwidth)
        return np.maximum(value, transfer / (self.bandwidth * m))

    def fits(self, p, m, machines: int, which: str = "any"):
        """The last stage (pair ``p``, ``m`` replicas) of ``machines`` fits the memory limit:
        as it is (``which="plain"``), recomputing (``"again"``), or either (``"any"``).

        A worker's memory grows only with its stage's depth ``ceil(workers from here / m)``
        (:mod:`pipetrain.plan.stage_memory`), so each pair has a deepest depth that fits, found once.
        """
        m = np.asarray(m)
        depth = (self.memory.workers - machines + 2 * m - 1) // m
        return depth <= self.deepest(which)[p]

    def deepest(self, which: str = "any") -> np.ndarray:
        """Per pair, the deepest depth that fits (:meth:`fits`), computed once per kind."""
        cache = self.__dict__.setdefault("_deepest", {})
        if which not in cache:
            if which == "any":
                cache[which] = self.deepest("plain") if not self._recomputing() else \
                    np.maximum(self.deepest("plain"), self.deepest("again"))
            else:
                cache[which] = self._deepest_fitting(recompute=which == "again")
        return cache[which]

    def _deep_enough(self, deepest: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """The fewest machines at which a last stage whose prefix needs ``lo`` fits: on
        ``m <= M - lo`` replicas its depth is ``ceil((W - M + m) / m)``, at most ``deepest``
        where it fits, so ``M >= (W + (deepest - 1) lo) / deepest``."""
        d = deepest.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil((self.memory.workers + (d - 1) * lo) / d)
        return np.where((d > 0) & np.isfinite(lo), need, np.inf)

    def _deepest_fitting(self, recompute: bool = False) -> np.ndarray:
        """Per pair: the largest depth ``d <= workers`` whose memory fits (0: none)."""
        k, j = self.ranges.pair_k, self.ranges.pair_j
        workers, limit = self.memory.workers, self.memory.limit
        lo = np.zeros(k.size, dtype=np.int64)
        hi = np.full(k.size, workers, dtype=np.int64)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                return lo
            mid = (lo[open_] + hi[open_] + 1) >> 1
            ok = self._mem(k[open_], j[open_], 1, mid, recompute) <= limit
            lo[open_] = np.where(ok, mid, lo[open_])
            hi[open_] = np.where(ok, hi[open_], mid - 1)

    # the table ----------------------------------------------------------------------------
    def _first(self, mode: str) -> Callable[[int], np.ndarray]:
        """One stage over each row's range on all ``M`` machines, flat over (row, j)."""
        cuts = self.s.cuts
        states = np.arange(cuts.num_states)
        r, j = self.rows[:, None], states[None, :]
        outside = None if self.band is None else ~self.band
        empty = np.full(len(self.rows) * cuts.num_states, np.inf)

        def first(machines: int) -> np.ndarray:
            if self.s.straight and machines > 1:
                return empty
            value = self.single(r, j, machines, mode)
            if outside is not None:
                value = np.where(outside, np.inf, value)
            return value.ravel()

        return first

    def solve(self, mode: str = "time") -> np.ndarray:
        """Fill ``table[machines, row, j]`` for every machine count, row and cut ``j``."""
        static = mode == "time" and not self._limited()
        windows, bound, keep = None, math.inf, None
        if mode == "time" and self.final and (self.bound is not None or
                                              (static and self.n >= WINDOW_MACHINES)):
            found = self._windows(self.bound)
            if found is not None:
                windows, fewest_machines, most_machines, bound = found

                def keep(machines: int, row: np.ndarray) -> None:
                    row[(fewest_machines > machines) | (most_machines < machines)] = np.inf

        limited = mode == "time" and self._limited() and not self._recomputing()
        if limited:
            last, fits = (lambda p, m, machines: self.last_time(p, m)), self.fits
        else:  # (with recomputation the cost depends on the machine count: whether a stage fits as it is)
            last, fits = (lambda p, m, machines: self.last(p, m, machines, mode)), None
        effort = self.effort(windows)
        effort.check()
        progress, done = effort.progress(self.s.progress)
        try:
            table, running = solve_table(
                self.n, self.ranges, self._first(mode), last, fits=fits,
                replicate=not self.s.straight, fewer=self.s.fewer, keep=keep,
                static=static or limited, windows=windows, bound=bound, progress=progress)
        finally:
            done()
        shape = (self.n + 1, len(self.rows), self.s.cuts.num_states)
        table, running = table.reshape(shape), running.reshape(shape)
        if mode == "time":
            self.table, self.running = table, running
        return table

    def _fewest(self, bound: float) -> tuple[np.ndarray, ...]:
        """Fewest replicas within ``bound`` of every last stage and of one stage ``0 -> j``,
        each as (any count, at least 2), memory limit left out (fewer never hurts a bound)."""
        replicate = not self.s.straight
        pairs = self.ranges.pair_k.size
        states = self.s.cuts.num_states
        last = fewest(self.last_time, pairs, self.n, bound, replicate)
        first = fewest(lambda j, m: self.single(np.zeros_like(j), j, m, limit=False), states,
                       self.n, bound, replicate)
        return last + first

    def reach(self, bound: float) -> tuple[np.ndarray, ...]:
        """Within ``bound``: the fewest machines of every prefix ``0 -> j`` and of every rest
        ``j -> end``, and the fewest replicas of every last stage and one-stage prefix."""
        cuts = self.s.cuts
        k, j = self.ranges.pair_k, self.ranges.pair_j
        replicas, _, first, _ = self._fewest(bound)
        first[0] = np.inf
        lo = prefix_fewest(k, j, first, replicas)
        g = suffix_fewest(k, j, cuts.num_states, replicas)
        return lo, g, replicas, first

    def _windows(self, bound: float | None = None
                 ) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, float] | None:
        """Last level: the machine-count windows of a plan within ``bound``
        (:mod:`pipetrain.plan.window`), with the bound found by bisection if not given; None
        where no bound is found."""
        cuts = self.s.cuts
        k, j = self.ranges.pair_k, self.ranges.pair_j
        end = cuts.num_states - 1

        def feasible(bound: float) -> bool:
            replicas, two, first, first_two = self._fewest(bound)
            lo = prefix_fewest(k, j, first, replicas)
            if self.s.fewer:
                return bool(lo[end] <= self.n)
            return bool(threshold(k, j, lo, two, replicas == 1, first_two)[end] <= self.n)

        if bound is None:
            high = float(self.single(np.array(0), np.array(end), self.n))
            low = float(cuts.compute[end]) / self.s.topology.workers
            if not (math.isfinite(high) and feasible(high)):
                return None
            bound = upper_bound(feasible, low, high)
        lo, g, replicas, _ = self.reach(bound)
        pair = self.ranges.pair
        start = lo[k[pair]] + replicas[pair]
        if self._limited():
            start = np.maximum(start, self._deep_enough(self.deepest()[pair], lo[k[pair]]))
        stop = self.n - g[j[pair]]
        as_int = (lambda x: np.clip(x, -1, self.n + 1).astype(np.int64))   # inf: never
        return (as_int(lo[k[pair]]), as_int(start), as_int(stop)), as_int(lo), \
            as_int(self.n - g), bound

    # traceback ----------------------------------------------------------------------------
    def choose(self, r: int, j: int, machines: int) -> tuple:
        """The decision behind ``table[machines, r -> j]``: the first minimum in the order
        one stage, an idle worker, then the last stage's cut (earliest first), then its replicas
        (fewest first)."""
        cuts = self.s.cuts
        row = int(self.row_of[r])
        options: list[tuple] = []
        values: list[float] = []
        if not (self.s.straight and machines > 1):
            options.append(("single",))
            values.append(float(self.single(np.array(r), np.array(j), machines)))
        if self.s.fewer and machines > 1:
            options.append(("fewer",))
            values.append(float(self.table[machines - 1, row, j]))
        ks = np.flatnonzero(cuts.ancestors[r] & cuts.ancestors[:, j])
        ks = ks[ks >= 1]
        pairs = self.ranges.pair_id[ks, j]
        ks, pairs = ks[pairs >= 0], pairs[pairs >= 0]
        if ks.size and machines >= 2:
            width = self.table.shape[2]
            value, pick, m = best_split(
                self.table.reshape(self.n + 1, -1), self.running.reshape(self.n + 1, -1),
                row * width + ks, pairs, machines, lambda p, mm, M: self.last(p, mm, M),
                replicate=not self.s.straight)
            options.append(("split", int(ks[pick]), m))
            values.append(value)
        best = int(np.argmin(values)) if values else -1
        if best < 0 or not math.isfinite(values[best]):
            raise PipetrainError("internal: no finite decision while tracing the plan back")
        return options[best]
