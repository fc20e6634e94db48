"""Evaluating a model on a data set: mean loss and accuracy over all targets (samples or tokens)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.data.info import get_batch
from pipetrain.models.loss import LossFn, accuracy_counts, cross_entropy, target_count
from pipetrain.structure import map_values

__all__ = ["Metrics", "evaluate"]


class Metrics:
    """Running loss and accuracy over held-out batches, following the loss: each batch's mean loss
    is weighted by the number of targets it averages over (non-ignored tokens for a cross entropy,
    else samples), and accuracy compares predictions with targets as the loss does
    (:func:`~pipetrain.models.loss.accuracy_counts`), for class predictions only."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.loss = 0.0
        self.samples = self.correct = self.counted = 0
        self.classifies = True  # every batch so far had an accuracy

    def add(self, output: Any, target: Any) -> None:
        if isinstance(output, torch.Tensor):  # targets read on the CPU, on the output's device
            device = output.device
            target = map_values(target, lambda t: t if t.device == device else t.to(device))
        n = target_count(output, target, self.loss_fn)
        if n:
            self.loss += float(self.loss_fn(output, target)) * n
        self.samples += n
        counts = accuracy_counts(output, target, self.loss_fn)
        if counts is None:  # not a classification: no accuracy (regression, structured targets)
            self.classifies = False
        elif self.classifies:
            self.correct += counts[0]
            self.counted += counts[1]

    def result(self) -> dict[str, float | None]:
        """``{"loss", "accuracy"}``; ``accuracy`` is None where predictions are not classes."""
        return {"loss": self.loss / max(self.samples, 1),
                "accuracy": self.correct / max(self.counted, 1) if self.classifies else None}


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
    metrics = Metrics(loss_fn)
    n = len(dataset)  # type: ignore[arg-type]
    try:
        for start in range(0, n, batch_size):
            x, y = get_batch(dataset, torch.arange(start, min(start + batch_size, n)))
            metrics.add(model(x), y)
    finally:
        for module, flags in zip(modules, modes):
            for m, flag in zip(module.modules(), flags):
                m.training = flag
    result = metrics.result()
    return {
        **result,
        "bits_per_target": result["loss"] / math.log(2),
        "samples": float(n),
        "targets": float(metrics.counted if metrics.classifies else metrics.samples),
    }
