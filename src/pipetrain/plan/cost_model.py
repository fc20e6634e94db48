"""The two cost models of PipeDream's optimizer: one stage's time, its transfers, data parallelism.

``pipedream-code`` adds the all-reduce to the compute (the public optimizer); ``paper`` overlaps
them (``max``). The formulas are in :mod:`pipetrain.plan.optimizer`'s docstring; the DP
(:mod:`pipetrain.plan.level`), the plan's description and the baselines price stages with them.
"""

from __future__ import annotations

import numpy as np

from pipetrain.plan.topology import Topology

__all__ = ["COST_MODELS", "stage_time", "transfer_in", "transfer_out", "data_parallel_time"]

COST_MODELS = ("pipedream-code", "paper")


def stage_time(model: str, seg, pseg, m, bandwidth: float, within: float = 1.0,
                single: bool = False):
    """Time of one stage replicated ``m`` ways (``within`` only for a one-stage pipeline)."""
    if model == "paper":
        return np.maximum(seg, (4 * (m - 1) * pseg) / (bandwidth * m)) / m
    sync = (4 * (m - 1) * pseg) / (bandwidth * m)
    if single:
        sync = sync / within
    return (seg + sync) / m


def transfer_in(model: str, out, m, bandwidth: float):
    if model == "paper":
        return (2.0 * out) / bandwidth
    return (2.0 * out) / (bandwidth * m)


def transfer_out(model: str, out, m, bandwidth: float, is_end):
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
