"""The planner's front door: a plan for a profile, a schedule choice, and the baselines beside it."""

from __future__ import annotations

import re
import time

from pipetrain.errors import PipetrainError
from pipetrain.plan.baselines import BASELINES, baseline
from pipetrain.plan.graph import Cuts, build_cuts
from pipetrain.plan.memory import SCHEDULES, check_schedule
from pipetrain.plan.pipedream import optimize
from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan
from pipetrain.plan.topology import Topology

__all__ = ["make_plan", "compare_baselines", "training_hints"]


def make_plan(profile: Profile | Cuts, topology: Topology, *, schedule: str = "pipedream",
              cost_model: str = "pipedream-code", straight: bool = False,
              fewer_machines: bool = False, memory_limit: float | None = None,
              microbatches: int | None = None) -> Plan:
    """PipeDream's optimizer for one schedule, or for each with ``schedule="auto"``.

    ``auto`` keeps the schedule with the least time per minibatch (pipeline bubble included for
    the schedules that flush) among those whose plan fits ``memory_limit``. ``microbatches``
    defaults to the worker count for the schedules that use microbatches.
    """
    started = time.perf_counter()
    cuts = profile if isinstance(profile, Cuts) else build_cuts(profile)
    names = list(SCHEDULES) if schedule == "auto" else [check_schedule(schedule)]
    plans: list[Plan] = []
    errors: list[tuple[str, PipetrainError]] = []
    for name in names:
        m = 1 if name == "pipedream" else (microbatches or topology.workers)
        try:
            plans.append(optimize(cuts, topology, cost_model=cost_model, straight=straight,
                                  fewer_machines=fewer_machines, memory_limit=memory_limit,
                                  schedule=name, microbatches=m))
        except PipetrainError as error:
            if schedule != "auto":
                raise
            errors.append((name, error))
    if not plans:
        smallest = _smallest(errors)
        raise PipetrainError(
            f"no schedule ({', '.join(names)}) fits a plan in the memory limit"
            + (f"; the smallest limit that fits any of them is {smallest}" if smallest else "")
            + ": raise --memory or add workers")
    best = min(plans, key=lambda p: p.time_per_minibatch_with_bubble)
    if schedule == "auto":
        best.extra["schedule_candidates"] = [
            {"schedule": p.schedule, "time_per_minibatch_with_bubble":
             p.time_per_minibatch_with_bubble, "replicas": p.replicas,
             "peak_memory_bytes": max(s.memory_bytes or 0.0 for s in p.stages)} for p in plans
        ] + [{"schedule": name, "error": str(error)} for name, error in errors]
    best.solve_seconds = time.perf_counter() - started
    return best


def _smallest(errors: list[tuple[str, PipetrainError]]) -> str | None:
    found = []
    for name, error in errors:
        match = re.search(r"smallest memory limit that fits is ([^(]+)\((\d+) bytes\)", str(error))
        if match:
            found.append((int(match.group(2)), f"{match.group(1).strip()} with {name}"))
    return min(found)[1] if found else None


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
