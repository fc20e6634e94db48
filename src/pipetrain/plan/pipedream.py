"""PipeDream's partitioning optimizer: stages, replication, a hierarchical topology.

Dynamic programming over (cut, cut, machines), level by level (Narayanan et al., SOSP 2019,
section 3.1; DESIGN 3.6). At level ``l`` with ``n`` components joined by bandwidth ``B``::

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
weight versions and minibatches of activations). Deviation from the public code, on purpose: with
``fewer_machines`` a one-layer range may also use fewer replicas, and for DAG models the ranges of
inner levels are only ever between nested cuts (the public code also subtracts unrelated ones).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.memory import check_schedule, format_bytes, stage_memory
from pipetrain.plan.minmax import (minmax_band, minmax_dense, minmax_hybrid, minmax_monotone,
                                   monotone_limit)
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan, Stage
from pipetrain.plan.topology import Topology

__all__ = ["optimize", "COST_MODELS", "data_parallel_time"]

COST_MODELS = ("pipedream-code", "paper")
_BAND_START = 2.0   # first upper bound on a banded solve: this many times the lower bound
_BAND_GROWTH = 1.5  # a banded solve found nothing within its bound: the next bound, this times
_BAND_PASSES = 4    # banded solves before the whole table
_BANDED_COST_ELEMENTS = 8_000_000   # largest table of banded last-stage costs (64 MB)
_BAND_DENSE_DEPTH = 400             # inner levels try every cut while the band is this shallow


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


class _Level:
    """The DP table of one topology level, with the formulas it was built from."""

    def __init__(self, solver: "_Solver", index: int, seg: Callable,
                 limit: np.ndarray | None = None, stops: np.ndarray | None = None,
                 bound: float | None = None) -> None:
        self.s = solver
        self.index = index
        self.n = solver.topology.machines[index]
        self.bandwidth = solver.topology.bandwidths[index]
        self.within = solver.topology.machines[index - 1] if index > 0 else 1
        self.final = index == solver.topology.levels - 1
        self.seg = seg
        self.limit = limit              # chains: seg[1..limit[j], j] is non-increasing in k
        cuts = solver.cuts
        self.rows = np.array([0]) if self.final else np.arange(cuts.num_states - 1)
        self.memory = solver.memory if (self.final and solver.topology.levels == 1) else None
        self.table = np.full((self.n + 1, len(self.rows), cuts.num_states), np.inf)
        # a band of ranges (chains): only r -> j with j <= stops[r] can be in an optimal plan
        self.stops = self.first = self.columns = None
        if stops is not None:
            states = np.arange(cuts.num_states)
            if self.final:
                self.first = np.searchsorted(stops[:-1], states, side="left")
                self.columns = self._columns(bound)
                self.bound = bound
            else:
                self.stops = stops[self.rows]

    def _band_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every range ``r -> j`` of the band: (row index, r, j), grouped by row."""
        if not hasattr(self, "_ranges"):
            lengths = np.maximum(self.stops - self.rows, 0)
            index = np.repeat(np.arange(len(self.rows)), lengths)
            heads = np.cumsum(lengths) - lengths
            r = self.rows[index]
            self._ranges = (index, r, r + 1 + np.arange(index.size) - heads[index])
        return self._ranges

    def _columns(self, bound: float) -> tuple[np.ndarray, np.ndarray]:
        """Last level: the prefixes ``0 -> j`` on ``M`` machines an optimal plan can contain.

        A plan no slower than ``bound`` runs ``0 -> j`` on ``M`` components of ``W`` workers and
        ``j -> end`` on the other ``n - M``, each at least its compute over its workers: so
        ``compute(0 -> j) <= bound M W`` and ``compute(j -> end) <= bound (n - M) W``. Returns
        the first and last such ``j`` per ``M``.
        """
        compute = self.s.cuts.compute
        workers = math.prod(self.s.topology.machines[:-1])
        limit = bound * (1 + 1e-9) * workers
        machines = np.arange(self.n + 1)
        last = np.searchsorted(compute, limit * machines, side="right") - 1
        first = np.searchsorted(compute, compute[-1] - limit * (self.n - machines), side="left")
        return first, last

    # costs on index arrays (broadcasting) ------------------------------------------------
    def _mem(self, k, j, m, workers_from_here):
        c = self.s.cuts
        return stage_memory(self.memory.schedule, parameter_bytes=c.params[j] - c.params[k],
                            optimizer_bytes=c.optimizer[j] - c.optimizer[k],
                            activation_bytes=c.activations[j] - c.activations[k],
                            workers_from_here=workers_from_here, replicas=m,
                            microbatches=self.memory.microbatches)

    def _limited(self) -> bool:
        return self.memory is not None and self.memory.limit is not None

    def single(self, r, j, m, mode: str = "time"):
        """One stage ``r -> j`` on ``m`` replicas; ``inf`` where that is no stage."""
        cuts = self.s.cuts
        valid = cuts.ancestors[r, j]
        if mode == "memory":
            return np.where(valid, self._mem(r, j, m, self.memory.workers), np.inf)
        value = _stage_time(self.s.model, self.seg(r, j), cuts.params[j] - cuts.params[r], m,
                            self.bandwidth, self.within, single=True)
        if self._limited():
            value = np.where(self._mem(r, j, m, self.memory.workers) > self.memory.limit,
                             np.inf, value)
        return np.where(valid, value, np.inf)

    def stage(self, k, j, m, machines, mode: str = "time"):
        """Last stage ``k -> j`` on ``m`` replicas after a prefix of ``machines`` (no out term)."""
        cuts = self.s.cuts
        valid = cuts.ancestors[k, j] & (np.asarray(k) >= 1)
        if mode == "memory":
            return np.where(valid, self._mem(k, j, m, self.memory.workers - machines + m),
                            np.inf)
        value = _stage_time(self.s.model, self.seg(k, j), cuts.params[j] - cuts.params[k], m,
                            self.bandwidth)
        if self._limited():
            mem = self._mem(k, j, m, self.memory.workers - machines + m)
            value = np.where(mem > self.memory.limit, np.inf, value)
        return np.where(valid, value, np.inf)

    def tout(self, j, m, mode: str = "time"):
        cuts = self.s.cuts
        if mode == "memory":
            return np.zeros(np.shape(j))
        return _transfer_out(self.s.model, cuts.output[j], m, self.bandwidth,
                             np.asarray(j) == cuts.num_states - 1)

    def split(self, k, j, m, machines, mode: str = "time"):
        """Last stage with its out term: ``max(stage(k -> j), out(j))``."""
        return np.maximum(self.stage(k, j, m, machines, mode), self.tout(j, m, mode))

    def tin(self, k, m, mode: str = "time"):
        if mode == "memory":
            return np.zeros(np.shape(k))
        return _transfer_in(self.s.model, self.s.cuts.output[k], m, self.bandwidth)

    def replica_choices(self, machines: int) -> range:
        return range(1, 2) if self.s.straight else range(1, machines)

    # the table ----------------------------------------------------------------------------
    def solve(self, mode: str = "time") -> np.ndarray:
        """Fill ``table[machines, row, j]`` for every machine count, row and cut ``j``."""
        cuts = self.s.cuts
        table = np.full_like(self.table, np.inf)
        if cuts.chain:
            solve = self._solve_chain_rows if len(self.rows) > 1 else self._solve_chain_final
        else:
            solve = self._solve_dag
        for machines in range(1, self.n + 1):
            if self.s.straight and machines > 1:
                best = np.full((len(self.rows), cuts.num_states), np.inf)
            elif self.stops is not None:
                index, r, j = self._band_ranges()
                best = np.full((len(self.rows), cuts.num_states), np.inf)
                best[index, j] = self.single(r, j, machines, mode)
            else:
                states = np.arange(cuts.num_states)
                best = self.single(self.rows[:, None], states[None, :], machines, mode)
            choices = [m for m in self.replica_choices(machines)
                       if np.isfinite(table[machines - m]).any()]
            if choices:
                np.minimum(best, solve(table, machines, choices, mode), out=best)
            if self.s.fewer and machines > 1:
                np.minimum(best, table[machines - 1], out=best)
            if self.columns is not None:
                best[:, :self.columns[0][machines]] = np.inf
                best[:, self.columns[1][machines] + 1:] = np.inf
            table[machines] = best
        if mode == "time":
            self.table = table
        self._cache = {}
        return table

    def _prefix(self, table, machines, m, mode):
        states = np.arange(self.s.cuts.num_states)
        return np.maximum(table[machines - m], self.tin(states, m, mode)[None, :])

    def _solve_chain_final(self, table, machines, choices, mode):
        """Row 0 of a chain: one binary search per (replica count, cut), all at once."""
        ms = np.array(choices)
        nothing = np.full((1, self.s.cuts.num_states), np.inf)
        stops = mask = None
        if self.columns is not None:
            # only columns lo..hi are kept; their cuts k are at least first[lo] (first rises)
            lo, hi = self.columns[0][machines], self.columns[1][machines]
            if hi < lo:
                return nothing
            feasible = self._feasible() if mode == "time" and not self._limited() else None
            if feasible is not None:
                ms = ms[feasible[ms, lo:hi + 1].any(axis=1)]
                if ms.size == 0:
                    return nothing
                mask = feasible[ms]
            stops = np.full(ms.size, hi, dtype=np.int64)
        a = np.stack([self._prefix(table, machines, m, mode)[0] for m in ms])
        starts = np.zeros(ms.size, dtype=np.int64)
        if self.columns is not None:
            starts[:] = max(int(self.first[lo]), 1) - 1

        banded = self._banded_costs() if mode == "time" and not self._limited() else None
        if banded is not None:
            depth = banded.shape[2]
            plane = banded.shape[1] * depth
            flat = banded.ravel()

            def cost(p, k, j):
                return flat[ms[p] * plane + k * depth + (j - k)]
        elif mode == "time" and not self._limited():
            seg, pseg = self._flat_matrices()
            width = self.s.cuts.num_states
            out, end = self.s.cuts.output, self._end

            def cost(p, k, j):
                index = k * width + j
                m = ms[p]
                value = _stage_time(self.s.model, seg[index], pseg[index], m, self.bandwidth)
                return np.maximum(value, _transfer_out(self.s.model, out[j], m, self.bandwidth,
                                                       end[j]))
        else:
            def cost(p, k, j):
                return self.split(k, j, ms[p], machines, mode)

        if self.limit is None:
            cand = minmax_monotone(a, starts, cost, stops=stops, first=self.first, mask=mask)
        else:
            cand = minmax_hybrid(a, starts, cost, self.limit, stops=stops, first=self.first,
                                 mask=mask)
        return cand.min(axis=0, keepdims=True)

    def _banded_costs(self) -> np.ndarray | None:
        """Last level in a band: ``cost[m, k, j - k]`` of every last stage the band allows."""
        if self.first is None:
            return None
        if not hasattr(self, "_banded"):
            states = np.arange(self.s.cuts.num_states)
            depth = int(np.max(states - self.first, initial=0)) + 1
            self._banded = None
            if self.n * states.size * depth <= _BANDED_COST_ELEMENTS:
                k = states[:, None]
                j = np.minimum(k + np.arange(depth)[None, :], states.size - 1)
                inside = (j > k) & (self.first[j] <= k)
                k, j = np.broadcast_to(k, j.shape)[inside], j[inside]
                banded = np.full((self.n, states.size, depth), np.inf)
                for m in self.replica_choices(self.n):
                    banded[m][inside] = self.split(k, j, m, self.n)
                self._banded = banded
        return self._banded

    def _feasible(self) -> np.ndarray | None:
        """``[m, j]``: some last stage ``k -> j`` on ``m`` replicas is no slower than the bound
        (the others only price plans slower than it, which the band leaves out anyway)."""
        banded = self._banded_costs()
        if banded is None:
            return None
        if not hasattr(self, "_feasible_cache"):
            size = banded.shape[1]
            depth = np.arange(banded.shape[2])
            j = np.arange(size)[:, None]
            k = j - depth[None, :]
            inside = k >= 0
            cheapest = np.where(inside[None], banded[:, np.maximum(k, 0), depth[None, :]],
                                np.inf).min(axis=2)
            self._feasible_cache = cheapest <= self.bound * (1 + 1e-9)
        return self._feasible_cache

    def _flat_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """Base times (``inf`` where ``k -> j`` is no stage) and parameter bytes, flattened."""
        if not hasattr(self, "_flat"):
            cuts = self.s.cuts
            states = np.arange(cuts.num_states)
            valid = cuts.ancestors & (states[:, None] >= 1)
            seg = np.where(valid, self.seg(states[:, None], states[None, :]), np.inf)
            pseg = cuts.params[None, :] - cuts.params[:, None]
            self._flat = (seg.ravel(), pseg.ravel())
            self._end = states == cuts.num_states - 1
        return self._flat

    def _dense(self, m, machines, mode, key=""):
        """The (cut, cut) matrix of last-stage costs with out terms, cached per replica count."""
        cacheable = mode == "time" and not self._limited()
        cache = self.__dict__.setdefault("_cache", {})
        if cacheable and (m, key) in cache:
            return cache[(m, key)]
        states = np.arange(self.s.cuts.num_states)
        if self.stops is not None:
            _, k, j = self._band_ranges()
            full = np.full((states.size, states.size), np.inf)
            full[k, j] = self.split(k, j, m, machines, mode)
        else:
            full = self.split(states[:, None], states[None, :], m, machines, mode)
        if cacheable:
            if sum(v.size for v in cache.values()) > 40_000_000:
                cache.clear()
            cache[(m, key)] = full
        return full

    def _band_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Inner levels in a band: gather indices ``(r, k)`` of ``[r, k - r]`` and where they are
        inside the band; None if the band is too deep for :func:`minmax_band` to pay off."""
        if self.stops is None:
            return None
        if not hasattr(self, "_layout"):
            depth = int(np.max(self.stops - self.rows, initial=0)) + 1
            self._layout = None
            if depth <= _BAND_DENSE_DEPTH:
                r = self.rows[:, None]
                offset = np.arange(depth)[None, :]
                inside = offset <= (self.stops - self.rows)[:, None]
                k = np.minimum(r + offset, self.s.cuts.num_states - 1)
                self._layout = (np.broadcast_to(r, k.shape), k, inside)
        return self._layout

    def _band_costs(self, m, machines, mode, depth):
        """``[k, j - k]``: the last stage ``k -> j`` on ``m`` replicas in the band (padded)."""
        cacheable = mode == "time" and not self._limited()
        cache = self.__dict__.setdefault("_cache", {})
        if cacheable and (m, "band") in cache:
            return cache[(m, "band")]
        _, k, j = self._band_ranges()
        out = np.full((len(self.rows) + depth, depth), np.inf)
        out[k, j - k] = self.split(k, j, m, machines, mode)
        if cacheable:
            cache[(m, "band")] = out
        return out

    def _solve_chain_rows(self, table, machines, choices, mode):
        """Every row of a chain (inner levels): a 2-D binary search per replica count, or in a
        shallow band every cut, band layout."""
        best = np.full((len(self.rows), self.s.cuts.num_states), np.inf)
        layout = self._band_layout()
        if layout is not None:
            r, k, inside = layout
            depth = k.shape[1]
            banded = np.full(k.shape, np.inf)
            for m in choices:
                a = np.maximum(table[machines - m][r, k], self.tin(k, m, mode))
                a[~inside] = np.inf
                cand = minmax_band(a, self._band_costs(m, machines, mode, depth))
                np.minimum(banded, cand, out=banded)
            best[r[inside], k[inside]] = banded[inside]
            return best
        width = self.s.cuts.num_states
        for m in choices:
            a = self._prefix(table, machines, m, mode)
            full = self._dense(m, machines, mode).ravel()

            def cost(p, k, j, flat=full):
                return flat[k * width + j]

            if self.limit is None:
                cand = minmax_monotone(a, self.rows, cost, stops=self.stops)
            else:
                cand = minmax_hybrid(a, self.rows, cost, self.limit, stops=self.stops)
            np.minimum(best, cand, out=best)
        return best

    def _solve_dag(self, table, machines, choices, mode):
        cuts = self.s.cuts
        states = np.arange(cuts.num_states)
        best = np.full((len(self.rows), cuts.num_states), np.inf)
        sparse = len(self.rows) == 1
        if sparse and not hasattr(self, "_pairs"):
            anc = np.ascontiguousarray(cuts.ancestors[1:].T)
            jj, kk = np.nonzero(anc)                      # all stages k -> j, grouped by j
            kk = kk + 1
            starts = np.flatnonzero(np.r_[True, jj[1:] != jj[:-1]])
            seg = self.seg(kk, jj)
            pseg = cuts.params[jj] - cuts.params[kk]
            self._pairs = (kk, jj, starts, jj[starts], seg, pseg)
        cacheable = mode == "time" and not self._limited()
        cache = self.__dict__.setdefault("_cache", {})
        for m in choices:
            a = self._prefix(table, machines, m, mode)
            if sparse:
                kk, jj, starts, groups, seg, pseg = self._pairs
                if cacheable and (m, "pairs") in cache:
                    stage = cache[(m, "pairs")]
                elif cacheable:
                    stage = cache[(m, "pairs")] = _stage_time(self.s.model, seg, pseg, m,
                                                                self.bandwidth)
                else:
                    stage = self.stage(kk, jj, m, machines, mode)
                values = np.maximum(a[0, kk], stage)
                cand = np.full((1, cuts.num_states), np.inf)
                cand[0, groups] = np.minimum.reduceat(values, starts)
            else:
                ks = np.flatnonzero(np.isfinite(a).any(axis=0)[1:]) + 1
                if cacheable and (m, "stage") in cache:
                    full = cache[(m, "stage")]
                else:
                    full = self.stage(states[:, None], states[None, :], m, machines, mode)
                    if cacheable:
                        cache[(m, "stage")] = full
                cand = minmax_dense(a[:, ks], full[ks])
            np.maximum(cand, self.tout(states, m, mode)[None, :], out=cand)
            np.minimum(best, cand, out=best)
        return best

    # traceback ----------------------------------------------------------------------------
    def choose(self, r: int, j: int, machines: int) -> tuple:
        """The decision behind ``table[machines, r -> j]``: first minimum in a fixed order."""
        cuts = self.s.cuts
        row = 0 if self.final else r
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
        ms = np.array(list(self.replica_choices(machines)), dtype=np.int64)
        if ks.size and ms.size:
            # (k, m) grid in k-major order: first minimum = smallest cut, then fewest replicas
            kk, mm = ks[:, None], ms[None, :]
            grid = np.maximum(self.table[machines - mm, row, kk], self.tin(kk, mm))
            grid = np.maximum(grid, self.split(kk, j, mm, machines))
            flat = int(np.argmin(grid))
            options.append(("split", int(ks[flat // ms.size]), int(ms[flat % ms.size])))
            values.append(float(grid.ravel()[flat]))
        # first minimum in the order single, fewer, split
        best = int(np.argmin(values)) if values else -1
        if best < 0 or not math.isfinite(values[best]):
            raise PipetrainError("internal: no finite decision while tracing the plan back")
        return options[best]


class _Solver:
    def __init__(self, cuts: Cuts, topology: Topology, model: str, straight: bool,
                 fewer: bool, memory: _Memory) -> None:
        self.cuts = cuts
        self.topology = topology
        self.model = model
        self.straight = straight
        self.fewer = fewer
        self.memory = memory
        self.levels: list[_Level] = []

    def solve(self) -> float:
        """The best time per minibatch; chains over several levels are solved in a band."""
        if not (self.cuts.chain and self.topology.levels > 1):
            return self._solve_levels(None)
        if self.straight and not self.fewer and self.topology.workers > self.cuts.num_states - 1:
            return math.inf                     # fewer layers than workers: no straight plan
        # Every stage of the last level costs at least range_bound() of its range (below). With
        # an upper bound U on the optimum, ranges whose bound exceeds U are in no optimal plan,
        # nor are the ranges that contain them: inner levels solve only the band of shorter
        # ranges. A banded solution no slower than U is the exact optimum (the optimal plan
        # lies inside the band); otherwise U grows to that solution's time (then exact) or by
        # _BAND_GROWTH, and after _BAND_PASSES tries the whole table is solved.
        bound = _BAND_START * self._lower_bound()
        for _ in range(_BAND_PASSES):
            if not (math.isfinite(bound) and bound > 0):
                break
            stops = self._band(bound)
            if stops is None:
                break
            value = self._solve_levels(stops, bound)
            if value <= bound:
                return value
            bound = min(value, _BAND_GROWTH * bound)
        return self._solve_levels(None)

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
        layers = np.arange(last)
        return float(max(cuts.compute[last] / self.topology.workers,
                         np.max(self.range_bound(layers, layers + 1), initial=0.0)))

    def _band(self, bound: float) -> np.ndarray | None:
        """``stops[k]``: the last cut ``j`` with ``range_bound(k, j) <= bound`` (None: all)."""
        last = self.cuts.num_states - 1
        limit = bound * (1 + 1e-9)              # rounding: never cut a range the DP prices at U
        starts = np.arange(last + 1)
        lo = starts.copy()                      # range_bound(k, k) = 0 <= limit
        hi = np.full(last + 1, last)
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi + 1) >> 1
            ok = self.range_bound(starts, mid) <= limit
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)
        if lo[0] >= last:
            return None                         # the whole model fits: no band
        return np.maximum.accumulate(lo)

    def _solve_levels(self, stops: np.ndarray | None, bound: float | None = None) -> float:
        cuts = self.cuts
        compute = cuts.compute
        self.levels = []

        def seg_compute(k, j):
            return compute[j] - compute[k]

        seg: Callable = seg_compute
        limit = None
        for index in range(self.topology.levels):
            level = _Level(self, index, seg, limit, stops, bound)
            level.solve()
            self.levels.append(level)
            if not level.final:
                full = np.full((cuts.num_states, cuts.num_states), np.inf)
                full[:-1] = level.table[level.n]
                limit = monotone_limit(full) if cuts.chain else None
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


def optimize(profile: Profile | Cuts, topology: Topology | int, *,
             cost_model: str = "pipedream-code", straight: bool = False,
             fewer_machines: bool = False, memory_limit: float | None = None,
             schedule: str = "pipedream", microbatches: int = 1) -> Plan:
    """Partition ``profile`` over ``topology`` with PipeDream's optimizer.

    ``topology`` is a :class:`Topology` or a worker count (one level at 1e9 B/s). Returns a
    :class:`Plan` whose ``predicted_time_per_minibatch`` is the slowest stage's time.
    """
    if cost_model not in COST_MODELS:
        raise ConfigError(f"unknown cost model {cost_model!r}; choose {' or '.join(COST_MODELS)}")
    schedule = check_schedule(schedule)
    if int(microbatches) != microbatches or microbatches < 1:
        raise ConfigError(f"microbatches must be an integer >= 1, got {microbatches}")
    if not isinstance(topology, Topology):
        topology = Topology.flat(int(topology))
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    if memory_limit is not None and fewer_machines and topology.levels == 1:
        # idle workers change every stage's in-flight count: solve each worker count exactly
        solvers = [_Solver(cuts, Topology.flat(n, topology.bandwidths[0]), cost_model, straight,
                           False, _Memory(memory_limit, schedule, int(microbatches), n))
                   for n in range(1, topology.workers + 1)]
        times = [solver.solve() for solver in solvers]
        pick = int(np.argmin(times))
        solver, best = solvers[pick], times[pick]
        if not math.isfinite(best):
            smallest = min(s.smallest_memory() for s in solvers)
            _explain_infeasible(solver, cuts, topology, straight, True, memory_limit, schedule,
                                smallest)
    else:
        memory = _Memory(memory_limit, schedule, int(microbatches), topology.workers)
        solver = _Solver(cuts, topology, cost_model, straight, fewer_machines, memory)
        best = solver.solve()
        if not math.isfinite(best):
            _explain_infeasible(solver, cuts, topology, straight, fewer_machines, memory_limit,
                                schedule)
    flat = solver.stages()
    solve_seconds = time.perf_counter() - started
    stages = _describe(solver, flat)
    if memory_limit is not None and topology.levels > 1:
        worst = max(stage.memory_bytes or 0.0 for stage in stages)
        if worst > memory_limit:
            raise PipetrainError(
                f"the best plan over topology {topology.describe()} needs {format_bytes(worst)} "
                f"per worker, more than the limit {format_bytes(memory_limit)}; memory-constrained "
                "planning is exact for one-level topologies only: plan with a flat --bandwidth, "
                "or raise --memory")
    total_params = float(cuts.params[-1])
    return Plan(method="pipedream", stages=stages, predicted_time_per_minibatch=best,
                workers=topology.workers, schedule=schedule, microbatches=int(microbatches),
                cost_model=cost_model, topology=topology.describe(),
                single_worker_time=float(cuts.compute[-1]),
                data_parallel_time=data_parallel_time(float(cuts.compute[-1]), total_params,
                                                      topology, cost_model),
                solve_seconds=solve_seconds, memory_limit=memory_limit,
                extra={"straight": straight, "fewer_machines": fewer_machines})


def _explain_infeasible(solver: _Solver, cuts: Cuts, topology: Topology, straight: bool,
                        fewer: bool, memory_limit: float | None, schedule: str,
                        smallest: float | None = None) -> None:
    layers = cuts.num_states - 1
    if memory_limit is not None and topology.levels == 1:
        if smallest is None:
            smallest = solver.smallest_memory()
        if math.isfinite(smallest):
            raise PipetrainError(
                f"no plan over {topology.workers} workers fits in {format_bytes(memory_limit)} "
                f"per worker with schedule {schedule}; the smallest memory limit that fits is "
                f"{format_bytes(smallest)} ({smallest:.0f} bytes): raise --memory to at least "
                "that, add workers, or pick a schedule that stashes less (2bw, 1f1b)")
    if straight and not fewer and topology.workers > layers:
        raise PipetrainError(
            f"a straight pipeline over {topology.workers} workers needs at least "
            f"{topology.workers} cut points, but the model has only {layers}: use fewer workers, "
            "allow idle workers (--fewer-machines), or allow replication (drop --straight)")
    raise PipetrainError(f"no plan fits {topology.describe()} with these options; "
                         "try allowing idle workers (--fewer-machines)")


def _describe(solver: _Solver, flat: list) -> list[Stage]:
    cuts = solver.cuts
    topology = solver.topology
    model = solver.model
    stages: list[Stage] = []
    for a, b, path in flat:
        t = float(cuts.compute[b] - cuts.compute[a])
        compute = t
        replicas = 1
        for index, (m, kind, start, end) in enumerate(path):
            bandwidth = topology.bandwidths[index]
            within = topology.machines[index - 1] if index > 0 else 1
            pseg = float(cuts.params[end] - cuts.params[start])
            t = float(_stage_time(model, t, pseg, m, bandwidth, within, single=kind == "single"))
            replicas *= m
        tin = bandwidth_in = 0.0
        if a > 0:
            for index, (m, kind, start, end) in enumerate(path):
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
                            replicas_per_level=tuple(m for m, *_ in path)))
    attach_inputs_and_memory(cuts, stages, solver.memory.schedule, solver.memory.microbatches)
    return stages


def attach_inputs_and_memory(cuts: Cuts, stages: list[Stage], schedule: str,
                             microbatches: int) -> None:
    """Put input layers in stage 0 and dropped output sinks with their producer; fill memory."""
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
            microbatches=microbatches))
        before += stage.replicas
