"""Evaluating a model on a data set: mean loss and accuracy over all targets (samples or tokens)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.data.info import get_batch
from pipetrain.models.loss import LossFn, accuracy_counts, cross_entropy, target_count

__all__ = ["evaluate"]


def model_modules(model: Any) -> list[nn.Module]:
    """The modules behind ``model``: a staged model's stages, or the model itself."""
    stages = getattr(model, "stages", None)
    if stages is not None:
        return list(stages)
    return [model] if isinstance(model, nn.Module) else []


@torch.no_grad()
def evaluate(
    model: nn.Module | Callable[..., torch.Tensor],
    dataset: Dataset,
    *,
    batch_size: int = 256,
    loss_fn: LossFn = cross_entropy,
) -> dict[str, float | None]:
    """``{"loss", "accuracy", "bits_per_target", "samples", "targets"}`` of ``model`` on ``dataset``.

    Samples are read in order, ``batch_size`` at a time, through :func:`pipetrain.data.get_batch`.
    ``loss`` and ``accuracy`` are means over all target elements that count (per class label for
    classifiers, per token for ``gpt``: then ``bits_per_target`` is bits per character; targets
    equal to -100 are left out), compared as ``loss_fn`` says (``accuracy_counts``/``count``
    methods, see :mod:`pipetrain.models.loss`); ``accuracy`` is None where the predictions are not
    classes (a regression, structured targets).
    ``model`` may be a module, a :class:`~pipetrain.stages.StagedModel` or a callable; modules run
    in eval mode (restored afterwards).
    """
    modules = model_modules(model)
    modes = [[m.training for m in module.modules()] for module in modules]
    for module in modules:
        module.eval()
    total_loss = 0.0
    correct = 0
    targets = 0
    weight = 0  # targets the losses average over
    classifies = True
    n = len(dataset)  # type: ignore[arg-type]
    try:
        for start in range(0, n, batch_size):
            x, y = get_batch(dataset, torch.arange(start, min(start + batch_size, n)))
            out = model(x)
            counts = accuracy_counts(out, y, loss_fn)
            count = target_count(out, y, loss_fn)
            if count:
                total_loss += float(loss_fn(out, y)) * count
            weight += count
            if counts is None:  # not class predictions: no accuracy
                classifies = False
            correct += counts[0] if counts else 0
            targets += counts[1] if counts else count
    finally:
        for module, flags in zip(modules, modes):
            for m, flag in zip(module.modules(), flags):
                m.training = flag
    loss = total_loss / max(weight, 1)
    return {
        "loss": loss,
        "accuracy": correct / max(targets, 1) if classifies else None,
        "bits_per_target": loss / math.log(2),
        "samples": float(n),
        "targets": float(targets),
    }
