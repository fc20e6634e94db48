"""The loss and the metrics of the built-in models, for classification and for sequences alike.

Every built-in model is trained with :func:`cross_entropy`: for ``mlp``/``resmlp``/``resnet-gn*``
the output is logits ``(B, C)`` and the target class labels ``(B,)``; for ``gpt`` logits
``(B, T, V)`` and next-token targets ``(B, T)``. Both are the mean over all target elements
(samples, or tokens), so microbatches of equal shape average to the batch's loss.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.errors import ConfigError

__all__ = ["LossFn", "accuracy_counts", "cross_entropy", "loss_for"]

#: ``loss_fn(output, target) -> scalar tensor``, what the executors call on the last stage's output.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _flat(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(output, torch.Tensor) or output.dim() != target.dim() + 1:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ConfigError(
            f"cross entropy needs logits with one more dimension than the targets, (..., classes) "
            f"against (...); got output {shape} and target {tuple(target.shape)}"
        )
    if output.shape[:-1] != target.shape:
        raise ConfigError(
            f"cross entropy: output {tuple(output.shape)} does not match target {tuple(target.shape)} "
            f"(the output must be the target's shape plus a class dimension)"
        )
    return output.reshape(-1, output.shape[-1]), target.reshape(-1)


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits ``(..., C)`` against integer targets ``(...)``."""
    logits, labels = _flat(output, target)
    return F.cross_entropy(logits, labels)


def accuracy_counts(output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """``(correct, total)``: arg-max predictions equal to the target, over all target elements."""
    logits, labels = _flat(output, target)
    return int((logits.argmax(dim=-1) == labels).sum()), labels.numel()


def loss_for(model: nn.Module | None = None) -> LossFn:
    """The loss to train ``model`` with: its ``pipeline_loss`` attribute if it has one (a user
    model declares its own loss that way), else :func:`cross_entropy` (every built-in model)."""
    custom = getattr(model, "pipeline_loss", None)
    if custom is not None:
        if not callable(custom):
            raise ConfigError(
                f"{type(model).__name__}.pipeline_loss must be callable as pipeline_loss(output, target)"
            )
        return custom
    return cross_entropy
