"""The planner's front door: a plan for a profile, a schedule choice, the baselines beside it."""

from __future__ import annotations

import time

from pipetrain.plan.baselines import BASELINES, baseline
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.stage_memory import CHUNKED, check_schedule
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan
from pipetrain.plan.search import search
from pipetrain.plan.topology import Topology
from pipetrain.schedule.costs import Costs

__all__ = ["make_plan", "compare_baselines", "training_hints"]


def make_plan(profile: Profile | Cuts, topology: Topology, *, schedule: str = "pipedream",
              cost_model: str = "pipedream-code", straight: bool = False,
              fewer_machines: bool = False, memory_limit: float | None = None,
              microbatches: int | None = None, progress: bool = False,
              recompute: bool = False, calibration: Costs | None = None) -> Plan:
    """PipeDream's optimizer for one schedule, or a simulated search with ``schedule="auto"``.

    ``auto`` (:func:`pipetrain.plan.search.search`) tries every schedule and microbatch count
    (only ``microbatches`` if given), scores each plan with the timeline simulator and keeps the
    fastest that fits ``memory_limit``. Otherwise ``microbatches`` defaults to the worker count
    for the schedules that use microbatches. ``progress``: see
    :func:`~pipetrain.plan.optimizer.optimize`. ``recompute``: under ``memory_limit``, a stage
    that would not fit may keep only its inputs and recompute its forward in the backward, its
    time including that forward (one-level topologies; not under zb-h1). The chunked schedules
    (interleaved, bfs, interleaved-zb, zb-v, v-half, v-min, dualpipev) are planned by that search
    alone, with ``microbatches`` (default twice the worker count), without recomputation.
    ``calibration`` (``pipetrain calibrate``'s costs): the simulations of ``auto`` and of the
    chunked schedules also charge its per-action and per-message costs
    (:func:`~pipetrain.plan.search.simulate_plan`).
    """
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    if schedule == "auto":
        return search(cuts.profile, topology, memory_limit=memory_limit,
                      microbatches=[microbatches] if microbatches else None,
                      cost_model=cost_model, straight=straight, fewer_machines=fewer_machines,
                      cuts=cuts, recompute=recompute, calibration=calibration)
    name = check_schedule(schedule)
    m = 1 if name == "pipedream" else (microbatches or topology.workers)
    if name in CHUNKED:  # several stages per worker: cut by time and simulated (search's docstring)
        m = microbatches or 2 * topology.workers  # the V schedules need 2W-1 to fill their V
        return search(cuts.profile, topology, memory_limit=memory_limit, schedules=[name], microbatches=[m],
                      cost_model=cost_model, cuts=cuts, calibration=calibration)
    plan = optimize(cuts, topology, cost_model=cost_model, straight=straight,
                    fewer_machines=fewer_machines, memory_limit=memory_limit, schedule=name,
                    microbatches=m, progress=progress, recompute=recompute)
    plan.solve_seconds = time.perf_counter() - started
    return plan


def compare_baselines(profile: Profile | Cuts, topology: Topology, *,
                      cost_model: str = "pipedream-code", schedule: str = "pipedream",
                      microbatches: int = 1) -> list[Plan]:
    """The baseline partitioners, priced with the same cost model."""
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    return [baseline(method, cuts, topology, cost_model=cost_model, schedule=schedule,
                     microbatches=microbatches) for method in BASELINES]


def training_hints(plan: Plan, profile: Profile) -> dict:
    """``balance`` (units per stage) and ``split_at`` (first module of each later stage).

    These are what ``pipetrain train --balance / --split-at`` take, when the profile came from
    ``pipetrain profile`` of the same model (units are its top-level children or fx modules).
    """
    inputs = {layer.name for layer in profile.layers if layer.input}
    modules = profile.meta.get("modules") or {}
    balance = [sum(1 for name in stage.layers if name not in inputs) for stage in plan.stages]
    split_at = []
    for stage in plan.stages[1:]:
        first = next((name for name in stage.layers if name not in inputs), None)
        if first is not None:
            split_at.append(modules.get(first, first))
    return {"balance": balance, "split_at": split_at}
