"""The live objects of a run: model, data sets, loss and optimizers.

A run is one :class:`~pipetrain.training.config.TrainConfig` (plain options: schedule, batch size,
outputs, ...) plus these parts. The Python API takes them from the user as objects; the command
line builds them from its spec strings (:func:`parts_from_config`). Everything after that,
set-up, executors and outputs, is the same code for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

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
    :class:`~pipetrain.stages.StagedModel`), or ``None`` to cut it as the configuration says.
    """

    model: nn.Module | Sequence[nn.Module]
    train_set: Dataset
    test_set: Dataset | None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: OptimizerFactory | None = None
    staged: Any = None


def parts_from_config(config: TrainConfig) -> RunParts:
    """The parts named by the command line's specs: ``--data``/``--test-data`` loaded, ``--model``
    built for the data's input shape and class count (initialised under ``--seed``), its loss."""
    from pipetrain.data import dataset_info, load_dataset, load_train_test
    from pipetrain.models import build_model
    from pipetrain.models.loss import loss_for

    if config.test_data:
        train_set, test_set = load_dataset(config.data), load_dataset(config.test_data)
    else:
        train_set, test_set = load_train_test(config.data)
    info = dataset_info(train_set)
    model = build_model(config.model, input_shape=info.input_shape, num_classes=info.num_classes, seed=config.seed)
    return RunParts(model=model, train_set=train_set, test_set=test_set, loss_fn=loss_for(model))


def describe_model(model: nn.Module | Sequence[nn.Module]) -> str:
    """A short description of a user's model for reports and checkpoint fingerprints: its class
    and the shapes of its parameters (a checkpoint of another model is then refused)."""
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    shapes = [tuple(p.shape) for m in modules for p in m.parameters()]
    import hashlib

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
