"""Training runs: configuration, set-up shared by every executor, results and reports."""

from pipetrain.training.config import TrainConfig

__all__ = ["TrainConfig", "Run", "prepare"]


def __getattr__(name: str):
    # The set-up imports PyTorch: load it on first use, so that a configuration can be built and
    # checked (pipetrain.training.validate) without it, and a bad argument is reported at once.
    if name in ("Run", "prepare"):
        from pipetrain.training import setup  # late on purpose: see above

        return getattr(setup, name)
    raise AttributeError(f"module 'pipetrain.training' has no attribute {name!r}")
