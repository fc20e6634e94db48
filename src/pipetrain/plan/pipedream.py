"""PipeDream's partitioning optimizer: stages, replication, a hierarchical topology.

Dynamic programming over (cut, cut, machines), level by level (Narayanan et al., SOSP 2019,
section 3.1; docs/design.md 3.6). At level ``l`` with ``n`` components joined by bandwidth ``B``::

    A(r -> j, M) = min( T(r -> j, M),                                   # one stage, M replicas
                        min over cuts k, m' < M of
                            max(A(r -> k, M - m'), T(k -> j, m'), in(k, m'), out(j, m')) )

where ``T`` prices one stage. The level's "compute" of a range is the compute time at level 1 and
the previous level's best pipeline ``A_{l-1}(r -> j, n_{l-1})`` above, so every level but the last
solves all ranges; the last solves only the whole model. Two cost models:

``pipedream-code`` (the public optimizer, ``optimizer_graph_hierarchical.py``)
    ``T = (compute + 4 (m-1)/m * params / B) / m``, all-reduce added to compute; a one-stage
    pipeline's all-reduce is further divided by the previous level's size, as in that code.
    ``in(k, m') = 2 out_k / (B m')``; ``out(j, m') = 2 out_j / (B m')`` unless ``j`` is the end.
``paper``
    ``T = max(compute, 4 (m-1)/m * params / B) / m`` (compute and all-reduce overlap),
    ``in(k) = 2 out_k / B``, no ``out`` term.

Options: ``straight`` (no replication), ``fewer_machines`` (a plan may leave workers idle: with it,
more workers never give a worse plan), and a memory limit per worker for a single-level topology
(see :mod:`pipetrain.plan.memory`; stage ``s`` of PipeDream holds ``ceil(workers from s / r_s)``
weight versions and minibatches of activations). Under a memory limit, ``recompute`` lets a stage
that does not fit keep only its inputs and run its forward again in its backward: priced ``T`` of
``compute + forward`` instead of ``compute`` (the forward once more per minibatch), and chosen
only where the stage would not fit otherwise, so a stage's cost is the cheaper of the options
that fit. Each option's cost falls with more replicas and fewer workers after the stage, so their
minimum does too, which is all the sweep below needs.

Deviation from the public code, on purpose: with ``fewer_machines`` a one-layer range may also use
fewer replicas, and for DAG models the ranges of inner levels are only ever between nested cuts
(the public code also subtracts unrelated ones).

The tables are the recurrence's, filled so that thousands of workers take seconds (docs/planner.md,
"How it stays fast"): one machine count at a time with a crossing pointer per (row, k, j) instead
of a min over every ``m'`` (:mod:`pipetrain.plan.sweep`); large last levels only inside the
machine counts a plan within a bisected time can use (:mod:`pipetrain.plan.window`); several levels
in a band of the stages such a plan can have (:meth:`_Solver._band`); idle workers under a memory
limit by one DP built from the end of the model (:class:`_Mirror`). Each table's cost is
estimated first: long ones show progress, ones that would not finish are refused
(:mod:`pipetrain.plan.effort`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipetrain.errors import ConfigError, PipetrainError, name_options, option
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.memory import CHUNKED, RECOMPUTES, check_schedule, format_bytes, stage_memory
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan, Stage
from pipetrain.plan.effort import Effort
from pipetrain.plan.sweep import best_split, build_ranges, solve_table
from pipetrain.plan.topology import Topology
from pipetrain.plan.window import (fewest, nested_ranges, prefix_fewest, suffix_fewest,
                                   threshold, upper_bound)

__all__ = ["optimize", "COST_MODELS", "data_parallel_time"]

COST_MODELS = ("pipedream-code", "paper")
_BAND_START = 2.0   # first upper bound on a banded solve: this many times the lower bound
_BAND_GROWTH = 1.5  # a banded solve found nothing within its bound: the next bound, this times
_BAND_PASSES = 8    # banded solves before the whole table
_BAND_JUMP = 0.5    # a band this much of data parallelism's: solve that one (exact) instead
_WINDOW_MACHINES = 64  # last levels with this many machines or more are solved in windows
name_options({"memory_limit": "--memory"}, {})  # optimize(memory_limit=): `pipetrain plan --memory BYTES`


# --------------------------------------------------------------------------- cost formulas

def _stage_time(model: str, seg, pseg, m, bandwidth: float, within: float = 1.0,
                single: bool = False):
    """Time of one stage replicated ``m`` ways (``within`` only for a one-stage pipeline)."""
    if model == "paper":
        return np.maximum(seg, (4 * (m - 1) * pseg) / (bandwidth * m)) / m
    sync = (4 * (m - 1) * pseg) / (bandwidth * m)
    if single:
        sync = sync / within
    return (seg + sync) / m


def _transfer_in(model: str, out, m, bandwidth: float):
    if model == "paper":
        return (2.0 * out) / bandwidth
    return (2.0 * out) / (bandwidth * m)


def _transfer_out(model: str, out, m, bandwidth: float, is_end):
    if model == "paper":
        return np.zeros_like(np.asarray(out, dtype=np.float64))
    return np.where(is_end, 0.0, (2.0 * out) / (bandwidth * m))


def data_parallel_time(total_compute: float, total_params: float, topology: Topology,
                       model: str = "pipedream-code") -> float:
    """Time per minibatch of plain data parallelism over the whole topology, same cost model."""
    t, within = total_compute, 1
    for n, bandwidth in zip(topology.machines, topology.bandwidths):
        sync = (4 * (n - 1) * total_params) / (bandwidth * n)
        t = max(t, sync) / n if model == "paper" else (t + sync / within) / n
        within = n
    return t


# --------------------------------------------------------------------------- the DP

@dataclass
class _Memory:
    limit: float | None
    schedule: str
    microbatches: int
    workers: int
    recompute: bool = False  # a stage that does not fit may recompute its activations


class _Level:
    """The DP table of one topology level, with the formulas it was built from.

    Filled by :func:`pipetrain.plan.sweep.solve_table` over the level's (row, k, j) triples: the
    rows are every start cut for an inner level (the next level prices any range by this level's
    best pipeline over it) and only cut 0 for the last level.
    """

    def __init__(self, solver: "_Solver", index: int, seg: Callable,
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
        # the ranges band[r, j] (see _Solver._band)
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
            return _stage_time(self.s.model, self.seg(r, j) + extra, cuts.params[j] - cuts.params[r], m,
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
        value = _stage_time(self.s.model, seg, self.pair_params[p], m,
                            self.bandwidth)
        transfer = self.pair_transfer[p]
        if self.s.model == "paper":
            return np.maximum(value, transfer / self.bandwidth)
        return np.maximum(value, transfer / (self.bandwidth * m))

    def fits(self, p, m, machines: int, which: str = "any"):
        """The last stage (pair ``p``, ``m`` replicas) of ``machines`` fits the memory limit:
        as it is (``which="plain"``), recomputing (``"again"``), or either (``"any"``).

        A worker's memory grows only with its stage's depth ``ceil(workers from here / m)``
        (:mod:`pipetrain.plan.memory`), so each pair has a deepest depth that fits, found once.
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
                                              (static and self.n >= _WINDOW_MACHINES)):
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


class _Solver:
    progress = False   # show progress of long tables (a bar on a terminal, one line otherwise)

    def __init__(self, cuts: Cuts, topology: Topology, model: str, straight: bool,
                 fewer: bool, memory: _Memory) -> None:
        self.cuts = cuts
        self.topology = topology
        self.model = model
        self.straight = straight
        self.fewer = fewer
        self.memory = memory
        self.levels: list[_Level] = []

    def _without_limit(self, cuts, fewer: bool) -> float:
        """The best time per minibatch on ``cuts`` without the memory limit: a memory-limited plan
        is no faster, so machine windows start from it."""
        relaxed = _Solver(cuts, self.topology, self.model, self.straight, fewer,
                          dataclasses.replace(self.memory, limit=None))
        relaxed.progress = self.progress
        return relaxed.solve()

    def solve(self) -> float:
        """The best time per minibatch; topologies of several levels are solved in a band."""
        if self.topology.levels == 1:
            if self.memory.limit is None or self.topology.workers < _WINDOW_MACHINES:
                return self._solve_levels(None)
            # a memory limit: the plan without it is no slower, so its time is where machine
            # windows start (they never depend on the limit); widen until the plan is inside
            bound = self._without_limit(self.cuts, self.fewer)
            for _ in range(_BAND_PASSES):
                if not (math.isfinite(bound) and bound > 0):
                    break
                value = self._solve_levels(None, bound)
                if value <= bound:
                    return value
                bound *= _BAND_GROWTH
            return self._solve_levels(None)
        if self.straight and not self.fewer and self.topology.workers > self.cuts.num_states - 1:
            return math.inf                     # fewer layers than workers: no straight plan
        # Every stage of the last level costs at least range_bound() of its range (below). With
        # an upper bound U on the optimum, ranges whose bound exceeds U are in no optimal plan,
        # nor are the ranges that contain them: inner levels solve only the band of shorter
        # ranges. A banded solution no slower than U is the exact optimum (the optimal plan
        # lies inside the band). U starts at _BAND_START times a lower bound and grows to the
        # banded solution's time (a plan, so the next pass is exact) or by _BAND_GROWTH; after
        # _BAND_PASSES tries the whole table is solved. Passes below the optimum are cheap
        # where their bands are narrow; where a band is about as wide as that of plain data
        # parallelism (a plan: one stage at every level), that is solved instead, exactly.
        cap = math.inf
        if not self.straight:
            cap = data_parallel_time(float(self.cuts.compute[-1]), float(self.cuts.params[-1]),
                                     self.topology, self.model)
        capped = None
        bound = _BAND_START * self._lower_bound()
        for _ in range(_BAND_PASSES):
            if not (math.isfinite(bound) and bound > 0):
                break
            band = self._band(min(bound, cap))
            if bound < cap and math.isfinite(cap):
                capped = self._band(cap) if capped is None else capped
                if self._band_work(band) >= _BAND_JUMP * self._band_work(capped):
                    bound, band = cap, capped
            bound = min(bound, cap)
            value = math.inf if band is None else self._solve_levels(band, bound)
            if value <= bound:
                return value
            bound = min(value, _BAND_GROWTH * bound)
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
        probe = _Level(self, top.levels - 1, lambda k, j: (compute[j] - compute[k]) / inner)
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
            level = _Level(self, index, seg, bands.get(index), bound)
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


class _MirrorLevel(_Level):
    """A one-level table of the reversed model: entry ``M, 0 -> j`` is the original rest from
    cut ``end - j`` to the end on ``M`` machines, so a stage's workers from here are the
    entry's ``M`` whatever the total (:class:`_Mirror`).

    Transfers as the original pays them: a stage pays for its input, and a middle stage also
    for its output; so the original first stage (reversed: a last stage ending at ``end``)
    pays nothing.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cuts = self.s.cuts
        k, j = self.ranges.pair_k, self.ranges.pair_j
        first = j == cuts.num_states - 1
        if self.s.model == "paper":
            self.pair_transfer = np.where(first, 0.0, 2.0 * cuts.output[j])
        else:
            self.pair_transfer = np.where(first, 0.0,
                                          2.0 * np.maximum(cuts.output[k], cuts.output[j]))

    def _input_bytes(self, k, j):
        """The original stage's input: the cut at its start, reversed cut ``j``."""
        return self.s.cuts.output[j]

    def single(self, r, j, m, mode: str = "time", limit: bool = True):
        """The original last stage: one stage to the end, with its input transfer."""
        cuts = self.s.cuts
        valid = cuts.ancestors[r, j]
        if mode == "memory":
            return np.where(valid, self._least_mem(r, j, m, m), np.inf)
        out = np.where(np.asarray(j) == cuts.num_states - 1, 0.0, cuts.output[j])

        def time(extra=0.0):
            value = _stage_time(self.s.model, self.seg(r, j) + extra, cuts.params[j] - cuts.params[r], m,
                                self.bandwidth)
            return np.maximum(value, _transfer_in(self.s.model, out, m, self.bandwidth))

        value = time()
        if limit and self._limited():
            value = self._within_limit(r, j, m, m, value, lambda: time(self._forward(r, j)))
        return np.where(valid, value, np.inf)

    def last(self, p, m, machines: int, mode: str = "time"):
        if mode == "memory":
            k, j = self.ranges.pair_k[p], self.ranges.pair_j[p]
            return self._least_mem(k, j, m, machines)
        return super().last(p, m, machines, mode)

    def fits(self, p, m, machines: int, which: str = "any"):
        m = np.asarray(m)
        return (machines + m - 1) // m <= self.deepest(which)[p]

    def _deep_enough(self, deepest: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Depth ``ceil(M / m)`` with ``m <= M - lo``: ``M >= deepest lo / (deepest - 1)``."""
        d = deepest.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil(d * lo / (d - 1))
        return np.where((d > 1) & np.isfinite(lo), need, np.inf)


class _Mirror(_Solver):
    """PipeDream's one-level DP built from the end of the model: the best plan on exactly
    ``n`` workers for every ``n`` up to the topology's, memory limit included.

    A stage's memory depends on the workers from it to the end; built from the start, that
    needs the total, so idle workers (a smaller total) would need one solve per total. Built
    from the end it does not: the reversed model (cut ``j`` is the original ``end - j``; the
    prefix sums are negated so that every range's sums are the same floats) gives, in one
    table, the time of every total, exactly as the solve for that total would.
    """

    def __init__(self, cuts: Cuts, topology: Topology, model: str, straight: bool,
                 memory: _Memory) -> None:
        flip = (lambda values: -values[::-1])
        mirrored = dataclasses.replace(
            cuts, compute=flip(cuts.compute), params=flip(cuts.params),
            forward=None if cuts.forward is None else flip(cuts.forward),
            optimizer=flip(cuts.optimizer), activations=flip(cuts.activations),
            output=cuts.output[::-1].copy(),
            ancestors=np.ascontiguousarray(cuts.ancestors[::-1, ::-1].T))
        super().__init__(mirrored, topology, model, straight, False, memory)
        self.original = cuts

    def best(self, mode: str = "time") -> np.ndarray:
        """Per total ``n = 1..workers``: the best time (or, ``mode="memory"``, the smallest
        memory limit that fits); with many workers, times above the best are ``inf``.

        Many workers: machine windows (:mod:`pipetrain.plan.window`) from a bound that starts
        at the best time without the memory limit, idle workers allowed (never slower than any
        total with the limit) and widens until some total is within it.
        """
        compute = self.cuts.compute
        end = self.cuts.num_states - 1

        def solve(bound: float | None) -> np.ndarray:
            level = _MirrorLevel(self, 0, lambda k, j: compute[j] - compute[k], None, bound)
            return level.solve(mode=mode)[1:, 0, end]

        if mode == "memory" or self.topology.workers < _WINDOW_MACHINES:
            return solve(None)
        bound = self._without_limit(self.original, True)
        for _ in range(_BAND_PASSES):
            if not (math.isfinite(bound) and bound > 0):
                break
            times = solve(bound)
            if times.min() <= bound:
                return times
            bound *= _BAND_GROWTH
        return solve(None)


def optimize(profile: Profile | Cuts, topology: Topology | int, *,
             cost_model: str = "pipedream-code", straight: bool = False,
             fewer_machines: bool = False, memory_limit: float | None = None,
             schedule: str = "pipedream", microbatches: int = 1,
             progress: bool = False, recompute: bool = False) -> Plan:
    """Partition ``profile`` over ``topology`` with PipeDream's optimizer.

    ``topology`` is a :class:`Topology` or a worker count (one level at 1e9 B/s). Returns a
    :class:`Plan` whose ``predicted_time_per_minibatch`` is the slowest stage's time.
    ``recompute``: under ``memory_limit`` on a one-level topology, a stage that would not fit
    may recompute its activations (:data:`~pipetrain.plan.memory.RECOMPUTES` schedules), paying
    its forward once more per minibatch; the plan's stages say which do.
    ``progress``: show the progress of tables that take more than a few seconds (a bar on a
    terminal, one line on stderr otherwise). A size that would not finish here is refused with
    the largest that would (:mod:`pipetrain.plan.effort`).
    """
    if cost_model not in COST_MODELS:
        raise ConfigError(f"unknown cost model {cost_model!r}; choose {' or '.join(COST_MODELS)}")
    schedule = check_schedule(schedule)
    if schedule in CHUNKED:
        raise ConfigError(f"{schedule} holds several stages per rank: PipeDream's optimizer plans one stage per "
                          f"worker; plan it with make_plan or {option('schedule', 'auto')}")
    if int(microbatches) != microbatches or microbatches < 1:
        raise ConfigError(f"microbatches must be an integer >= 1, got {microbatches}")
    if not isinstance(topology, Topology):
        topology = Topology.flat(int(topology))
    recompute = (bool(recompute) and memory_limit is not None and schedule in RECOMPUTES
                 and topology.levels == 1)
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    if memory_limit is not None and fewer_machines and topology.levels == 1:
        # idle workers change every stage's in-flight count: the best plan on exactly n workers
        # for every n at once (built from the end), then the fastest n solved as usual
        memory = _Memory(memory_limit, schedule, int(microbatches), topology.workers, recompute)
        mirror = _Mirror(cuts, topology, cost_model, straight, memory)
        mirror.progress = progress
        times = mirror.best()
        pick = int(np.argmin(times))
        flat = Topology.flat(pick + 1, topology.bandwidths[0])
        solver = _Solver(cuts, flat, cost_model, straight, False,
                         _Memory(memory_limit, schedule, int(microbatches), pick + 1, recompute))
        solver.progress = progress
        best = solver.solve() if math.isfinite(times[pick]) else math.inf
        if not math.isfinite(best):
            smallest = float(np.min(mirror.best(mode="memory")))
            _explain_infeasible(solver, cuts, topology, straight, True, memory_limit, schedule,
                                smallest, recompute)
    else:
        memory = _Memory(memory_limit, schedule, int(microbatches), topology.workers, recompute)
        solver = _Solver(cuts, topology, cost_model, straight, fewer_machines, memory)
        solver.progress = progress
        best = solver.solve()
        if not math.isfinite(best):
            _explain_infeasible(solver, cuts, topology, straight, fewer_machines, memory_limit,
                                schedule, recompute=recompute)
    flat = solver.stages()
    solve_seconds = time.perf_counter() - started
    stages = _describe(solver, flat)
    if memory_limit is not None and topology.levels > 1:
        worst = max(stage.memory_bytes or 0.0 for stage in stages)
        if worst > memory_limit:
            raise PipetrainError(
                f"the best plan over topology {topology.describe()} needs {format_bytes(worst)} "
                f"per worker, more than the limit {format_bytes(memory_limit)}; memory-constrained "
                f"planning is exact for one-level topologies only: plan with a flat {option('bandwidth')}, "
                f"or raise {option('memory_limit')}")
    total_params = float(cuts.params[-1])
    return Plan(method="pipedream", stages=stages, predicted_time_per_minibatch=best,
                workers=topology.workers, schedule=schedule, microbatches=int(microbatches),
                cost_model=cost_model, topology=topology.describe(),
                single_worker_time=float(cuts.compute[-1]),
                data_parallel_time=data_parallel_time(float(cuts.compute[-1]), total_params,
                                                      topology, cost_model),
                solve_seconds=solve_seconds, memory_limit=memory_limit,
                extra={"straight": straight, "fewer_machines": fewer_machines,
                       **({"recompute": "auto"} if recompute else {})})


def _explain_infeasible(solver: _Solver, cuts: Cuts, topology: Topology, straight: bool,
                        fewer: bool, memory_limit: float | None, schedule: str,
                        smallest: float | None = None, recompute: bool = False) -> None:
    layers = cuts.num_states - 1
    if memory_limit is not None and topology.levels == 1:
        if smallest is None:
            smallest = solver.smallest_memory()
        if math.isfinite(smallest):
            also = f", or let stages recompute their activations ({option('recompute', True, cli='auto')})" if (
                not recompute and schedule in RECOMPUTES) else ""
            raise PipetrainError(
                f"no plan over {topology.workers} workers fits in {format_bytes(memory_limit)} "
                f"per worker with schedule {schedule}"
                + (" with recomputation" if recompute else "") + "; the smallest memory limit that fits is "
                f"{format_bytes(smallest)} ({smallest:.0f} bytes): raise {option('memory_limit')} to at least "
                f"that, add workers, or pick a schedule that stashes less (2bw, 1f1b){also}")
    if straight and not fewer and topology.workers > layers:
        raise PipetrainError(
            f"a straight pipeline over {topology.workers} workers needs at least "
            f"{topology.workers} cut points, but the model has only {layers}: use fewer workers, "
            f"allow idle workers ({option('fewer_machines')}), or allow replication (drop {option('straight')})")
    raise PipetrainError(f"no plan fits {topology.describe()} with these options; "
                         f"try allowing idle workers ({option('fewer_machines')})")


def _describe(solver: _Solver, flat: list) -> list[Stage]:
    cuts = solver.cuts
    topology = solver.topology
    model = solver.model
    memory = solver.memory
    stages: list[Stage] = []
    replicas_of = [math.prod(m for m, *_ in path) for _, _, path in flat]
    used, before = sum(replicas_of), 0
    for (a, b, path), count in zip(flat, replicas_of):
        compute = float(cuts.compute[b] - cuts.compute[a])
        # recomputes where the stage does not fit as it is (the choice the DP made: its memory
        # depends on the workers from it to the end only)
        again = memory.recompute and memory.limit is not None and float(stage_memory(
            memory.schedule, parameter_bytes=cuts.params[b] - cuts.params[a],
            optimizer_bytes=cuts.optimizer[b] - cuts.optimizer[a],
            activation_bytes=cuts.activations[b] - cuts.activations[a], workers_from_here=used - before,
            replicas=count, microbatches=memory.microbatches)) > memory.limit
        before += count
        extra = float(cuts.forward[b] - cuts.forward[a]) if again and cuts.forward is not None else 0.0
        t = compute + extra
        replicas = 1
        for index, (m, kind, start, end) in enumerate(path):
            bandwidth = topology.bandwidths[index]
            within = topology.machines[index - 1] if index > 0 else 1
            pseg = float(cuts.params[end] - cuts.params[start])
            t = float(_stage_time(model, t, pseg, m, bandwidth, within, single=kind == "single"))
            replicas *= m
        tin = bandwidth_in = 0.0
        if a > 0:
            for index, (m, kind, start, _) in enumerate(path):
                if kind == "split" and start == a:
                    bandwidth_in = topology.bandwidths[index]
                    tin = float(_transfer_in(model, cuts.output[a], m, bandwidth_in))
                    break
        layers = cuts.stage_layers(a, b)
        stages.append(Stage(layers=layers, replicas=replicas, compute_s=compute, time_s=t,
                            parameter_bytes=float(cuts.params[b] - cuts.params[a]),
                            optimizer_bytes=float(cuts.optimizer[b] - cuts.optimizer[a]),
                            activation_bytes=float(cuts.activations[b] - cuts.activations[a]),
                            input_transfer_s=tin, input_bytes=float(cuts.output[a]),
                            input_bandwidth=bandwidth_in,
                            replicas_per_level=tuple(m for m, *_ in path), recompute=bool(again),
                            recompute_s=extra))
    attach_inputs_and_memory(cuts, stages, solver.memory.schedule, solver.memory.microbatches)
    return stages


def attach_inputs_and_memory(cuts: Cuts, stages: list[Stage], schedule: str,
                             microbatches: int) -> None:
    """Put input layers in stage 0 and dropped output sinks with their producer; fill memory
    (with recomputation on the stages that recompute)."""
    stages[0].layers = list(cuts.inputs) + stages[0].layers
    where = {name: s for s, stage in enumerate(stages) for name in stage.layers}
    for tail, producers in cuts.tails.items():
        s = max((where[p] for p in producers if p in where), default=len(stages) - 1)
        stages[s].layers.append(tail)
    used = sum(stage.replicas for stage in stages)
    before = 0
    for stage in stages:
        stage.memory_bytes = float(stage_memory(
            schedule, parameter_bytes=stage.parameter_bytes,
            optimizer_bytes=stage.optimizer_bytes, activation_bytes=stage.activation_bytes,
            workers_from_here=used - before, replicas=stage.replicas,
            microbatches=microbatches, recompute=stage.recompute, input_bytes=stage.input_bytes))
        before += stage.replicas
