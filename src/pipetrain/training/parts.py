"""The live objects of a run: model, data sets, loss and optimizers.

A run is one :class:`~pipetrain.training.config.TrainConfig` (plain options: schedule, batch size,
outputs, ...) plus these parts. The Python API takes them from the user as objects; the command
line builds them from its spec strings (:func:`parts_from_config`). Everything after that,
set-up, executors and outputs, is the same code for both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.data import load_data
from pipetrain.models import build_model
from pipetrain.models.loss import loss_for
from pipetrain.training.config import TrainConfig

__all__ = ["RunParts", "OptimizerFactory", "parts_from_config", "describe_model", "describe_data"]

#: ``factory(stage, delay) -> StageOptimizer``: one optimizer per stage replica; ``delay`` is the
#: stage's staleness in updates (for Spike Compensation and Linear Weight Prediction).
OptimizerFactory = Callable[[int, int], Any]


@dataclass
class RunParts:
    """What a run trains, on and with.

    ``model``: an ``nn.Module`` or a list of stage modules; ``train_set`` and ``test_set``:
    map-style data sets of ``(x, y)`` (``test_set`` may be ``None``: no evaluation);
    ``loss_fn(output, target)``: a scalar mean over the samples; ``optimizer``: a per-stage
    factory, or ``None`` to build the optimizer from ``config.optimizer`` (a spec string);
    ``staged``: the model already cut into stages (a
    :class:`~pipetrain.stages.StagedModel`), or ``None`` to cut it as the configuration says;
    ``stage_choice``: how ``staged`` was chosen (a :class:`~pipetrain.stages.StageChoice`, for the
    run's heading and report; default: "the caller's cut").
    ``train_set`` may also be a ``DataLoader``: its batches are the updates
    (:class:`~pipetrain.data.LoaderBatches`). How each rank gives the stages of a model built on
    the meta device their first values is the configuration's ``init``.
    """

    model: nn.Module | Sequence[nn.Module]
    train_set: Dataset
    test_set: Dataset | None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: OptimizerFactory | None = None
    staged: Any = None
    stage_choice: Any = None
    data_note: str = ""  # where the held-out data came from (pipetrain.data.load_data), for the report
    schedule_choice: Any = None  # pipetrain.plan.choose.AutoChoice: how schedule="auto" chose (Pipeline's choice)


def parts_from_config(config: TrainConfig) -> RunParts:
    """The parts named by the command line's specs: ``--data``/``--test-data``/``--holdout``
    loaded (:func:`pipetrain.data.load_data`), ``--model`` built for the data's input shape and
    class count (initialised under ``--seed``, or on the meta device with ``--init meta``), its loss."""
    train_set, test_set, info, note = load_data(config.data, config.test_data, config.holdout)
    model = build_model(config.model, input_shape=info.input_shape, num_classes=info.num_classes, seed=config.seed,
                        meta=config.init is not None and config.init.on_meta)
    return RunParts(model=model, train_set=train_set, test_set=test_set, loss_fn=loss_for(model), data_note=note)


def describe_model(model: nn.Module | Sequence[nn.Module]) -> str:
    """A short description of a user's model for reports and checkpoint fingerprints: its class
    and the shapes of its parameters (a checkpoint of another model is then refused)."""
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    shapes = [tuple(p.shape) for m in modules for p in m.parameters()]

    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    name = "+".join(type(m).__qualname__ for m in modules) if len(modules) < 4 else f"{len(modules)} stages"
    return f"{name} ({sum(p.numel() for m in modules for p in m.parameters())} parameters, shapes {digest})"


def describe_data(data: Any) -> str:
    """A short description of a user's data set: its class and length."""
    try:
        size = f"{len(data)} items"
    except TypeError:
        size = "no len()"
    return f"{type(data).__qualname__} ({size})"
