"""Forward-only evaluation on held-out data: mean loss and accuracy."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["accuracy_counts", "evaluate_chain"]


def accuracy_counts(output: Tensor, target: Tensor) -> tuple[int, int]:
    """(correct, total) of arg-max predictions; per position for sequence outputs."""
    predicted = output.argmax(dim=-1)
    return int((predicted == target).sum()), target.numel()


def evaluate_chain(
    forward: Callable[[Any], Tensor],
    batches: Sequence[tuple[Any, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> dict[str, float]:
    """Mean loss (weighted by samples) and accuracy of ``forward`` over ``batches``."""
    total_loss, samples, correct, counted = 0.0, 0, 0, 0
    with torch.no_grad():
        for inputs, target in batches:
            output = forward(inputs)
            n = target.shape[0]
            total_loss += float(loss_fn(output, target)) * n
            samples += n
            right, seen = accuracy_counts(output, target)
            correct += right
            counted += seen
    return {"loss": total_loss / max(samples, 1), "accuracy": correct / max(counted, 1)}
