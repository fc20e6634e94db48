"""pipetrain: pipeline-parallel training for PyTorch.

The public face: :class:`Pipeline` (train a model with any schedule in one process),
:func:`load_weights` (a weights directory written by ``save=DIR`` into the unsplit model),
:mod:`pipetrain.schedule` (the schedule IR, generators, validation and simulation) and the
`pipetrain` command.

The public names load on first use (``__getattr__`` below), on purpose: ``import pipetrain`` and the
command line's option checks then run without PyTorch.
"""

from pipetrain.errors import PipetrainError

__all__ = ["Pipeline", "PipetrainError", "load_weights"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Pipeline imports PyTorch; load it on first use so `pipetrain schedule` starts fast.
    if name == "Pipeline":
        from pipetrain.pipeline import Pipeline

        return Pipeline
    if name == "load_weights":
        from pipetrain.stages.materialize import load_weights

        return load_weights
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
