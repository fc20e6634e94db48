"""Training runs: configuration, set-up shared by every executor, results and reports."""

from pipetrain.training.config import TrainConfig
from pipetrain.training.setup import Run, prepare

__all__ = ["TrainConfig", "Run", "prepare"]
