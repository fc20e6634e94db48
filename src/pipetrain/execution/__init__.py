"""What every executor of the IR shares: versioned stage weights, the per-stage forward/backward
with the version an action names, and the mapping from pipeline units to training samples."""

from pipetrain.execution.data import UnitData, UnitLayout
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.tied_gradients import TiedGradients
from pipetrain.execution.version_store import VersionStore, version_release_points

__all__ = ["StageExecutor", "TiedGradients", "VersionStore", "version_release_points", "UnitData", "UnitLayout"]
