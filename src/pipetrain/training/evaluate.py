"""Forward-only evaluation on held-out data: mean loss and accuracy, as the loss counts them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from pipetrain.execution.device import to_device
from pipetrain.models.loss import accuracy_counts, target_count

__all__ = ["Metrics", "evaluate_chain"]


class Metrics:
    """Running loss and accuracy over held-out batches, following the loss: each batch's mean loss
    is weighted by the number of targets it averages over (non-ignored tokens for a cross entropy,
    else samples), and accuracy compares predictions with targets as the loss does
    (:func:`~pipetrain.models.loss.accuracy_counts`), for class predictions only."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.loss_fn = loss_fn
        self.loss = 0.0
        self.samples = self.correct = self.counted = 0
        self.classifies = True  # every batch so far had an accuracy

    def add(self, output: Tensor, target: Any) -> None:
        if isinstance(output, Tensor):  # targets read on the CPU
            target = to_device(target, output.device)
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


def evaluate_chain(
    forward: Callable[[Any], Tensor],
    batches: Sequence[tuple[Any, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> dict[str, float]:
    """Mean loss and accuracy of ``forward`` over ``batches`` (see :class:`Metrics`)."""
    metrics = Metrics(loss_fn)
    with torch.no_grad():
        for inputs, target in batches:
            metrics.add(forward(inputs), target)
    return metrics.result()
