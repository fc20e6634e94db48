"""Planning: profiles, cut points, PipeDream's optimizer, baselines, schedule search.

``profile_model`` imports PyTorch on first use; everything else here needs only numpy, so
``pipetrain plan`` starts quickly.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipetrain.plan.baselines import BASELINES, baseline
from pipetrain.plan.choose import choose_schedule
from pipetrain.plan.cost_model import COST_MODELS
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.planner import compare_baselines, make_plan
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.profile_files import load_profile, save_profile
from pipetrain.plan.result import Plan, Stage
from pipetrain.plan.search import search
from pipetrain.plan.topology import Topology

__all__ = ["LayerProfile", "Profile", "load_profile", "save_profile", "profile_model",
           "Topology", "optimize", "COST_MODELS", "baseline", "BASELINES", "make_plan",
           "compare_baselines", "search", "choose_schedule", "Plan", "Stage"]


def __getattr__(name: str) -> Any:
    if name == "profile_model":  # the profiler imports PyTorch: loaded when first asked for
        return importlib.import_module("pipetrain.plan.profiler").profile_model
    raise AttributeError(f"module 'pipetrain.plan' has no attribute {name!r}")
