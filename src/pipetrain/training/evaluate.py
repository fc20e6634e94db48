"""Forward-only evaluation on held-out data: mean loss and accuracy, as the loss counts them
(:class:`pipetrain.models.metrics.Metrics`, also what :func:`pipetrain.models.evaluate` sums)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from pipetrain.models.metrics import Metrics

__all__ = ["evaluate_chain"]


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
