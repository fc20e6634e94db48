"""pipetrain: pipeline-parallel training for PyTorch."""

from pipetrain.errors import PipetrainError

__all__ = ["PipetrainError"]
__version__ = "0.1.0"
