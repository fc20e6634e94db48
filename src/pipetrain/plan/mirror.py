"""PipeDream's one-level DP built from the end of the model: every total of workers at once.

Under a memory limit with idle workers allowed, a stage's memory depends on the workers from it to
the end; :class:`Mirror` solves the reversed model so one table holds the best plan on exactly
``n`` workers for every ``n`` (see :mod:`pipetrain.plan.optimizer`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipetrain.plan.cost_model import stage_time, transfer_in
from pipetrain.plan.graph import Cuts
from pipetrain.plan.level import WINDOW_MACHINES, Level, MemoryBudget
from pipetrain.plan.solver import BAND_GROWTH, BAND_PASSES, Solver
from pipetrain.plan.topology import Topology

__all__ = ["Mirror", "MirrorLevel"]


class MirrorLevel(Level):
    """A one-level table of the reversed model: entry ``M, 0 -> j`` is the original rest from
    cut ``end - j`` to the end on ``M`` machines, so a stage's workers from here are the
    entry's ``M`` whatever the total (:class:`Mirror`).

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
            value = stage_time(self.s.model, self.seg(r, j) + extra, cuts.params[j] - cuts.params[r], m,
                                self.bandwidth)
            return np.maximum(value, transfer_in(self.s.model, out, m, self.bandwidth))

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


class Mirror(Solver):
    """PipeDream's one-level DP built from the end of the model: the best plan on exactly
    ``n`` workers for every ``n`` up to the topology's, memory limit included.

    A stage's memory depends on the workers from it to the end; built from the start, that
    needs the total, so idle workers (a smaller total) would need one solve per total. Built
    from the end it does not: the reversed model (cut ``j`` is the original ``end - j``; the
    prefix sums are negated so that every range's sums are the same floats) gives, in one
    table, the time of every total, exactly as the solve for that total would.
    """

    def __init__(self, cuts: Cuts, topology: Topology, model: str, straight: bool,
                 memory: MemoryBudget) -> None:
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
            level = MirrorLevel(self, 0, lambda k, j: compute[j] - compute[k], None, bound)
            return level.solve(mode=mode)[1:, 0, end]

        if mode == "memory" or self.topology.workers < WINDOW_MACHINES:
            return solve(None)
        bound = self._without_limit(self.original, True)
        for _ in range(BAND_PASSES):
            if not (math.isfinite(bound) and bound > 0):
                break
            times = solve(bound)
            if times.min() <= bound:
                return times
            bound *= BAND_GROWTH
        return solve(None)
