"""The loss and the metrics of the built-in models, for classification and for sequences alike.

Every built-in model is trained with :func:`cross_entropy`: for ``mlp``/``resmlp``/``resnet-gn*``
the output is logits ``(B, C)`` and the target class labels ``(B,)``; for ``gpt`` logits
``(B, T, V)`` and next-token targets ``(B, T)``. Both are the mean over all target elements
(samples, or tokens) that count: a target equal to :data:`IGNORE_INDEX` (-100, PyTorch's
``ignore_index``: padding, the unmasked tokens of a masked LM) counts for nothing, in the loss,
its gradient and the accuracy.

A loss can say how its predictions meet the targets, and metrics follow it: a loss object with
``accuracy_counts(output, target) -> (correct, counted)`` is asked for the accuracy, and one with
``count(output, target)`` for the number of targets its mean is over (held-out losses are
weighted by it). :class:`CrossEntropy` has both, with a ``shift`` for models whose targets are
their inputs (``CrossEntropy(shift=1)`` compares the logits at position t with the target at
t + 1, as HuggingFace's causal LM heads do with ``labels=input_ids``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.data.info import class_labels
from pipetrain.errors import ConfigError
from pipetrain.structure import describe, first_tensor

__all__ = ["IGNORE_INDEX", "CrossEntropy", "LossFn", "accuracy_counts", "cross_entropy", "loss_for", "target_count"]

#: ``loss_fn(output, target) -> scalar tensor``, what the executors call on the last stage's output.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Targets with this value count for nothing (``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100


def _class_indices(target: Any) -> torch.Tensor:
    """``target`` as the class indices cross entropy takes (any integer dtype, as int64), or one
    ConfigError saying that these targets are not class labels and what to do instead."""
    if class_labels(target):
        return target if target.dtype == torch.int64 else target.to(torch.int64)
    got = (f"{str(target.dtype).replace('torch.', '')} targets" if isinstance(target, torch.Tensor)
           else f"targets {describe(target)}")
    raise ConfigError(
        f"cross entropy, the default loss, needs integer class labels; got {got}: pass a loss for these "
        f"targets as loss_fn (for regression torch.nn.MSELoss(), or a function of (output, target)), or give "
        f"the model a pipeline_loss, or make the labels integer class numbers"
    )


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


class CrossEntropy:
    """Mean cross entropy of logits ``(..., C)`` against integer targets ``(...)``, over the
    targets that count.

    Args:
        shift: compare the logits at position ``t`` of dimension 1 with the target at ``t + shift``
            (``1``: next-token prediction from targets equal to the inputs); ``0``: position by
            position.
        ignore_index: targets of this value count for nothing.

    A microbatch whose targets are all ignored has loss 0 and no gradient (not NaN).
    """

    def __init__(self, shift: int = 0, ignore_index: int = IGNORE_INDEX) -> None:
        if not isinstance(shift, int) or shift < 0:
            raise ConfigError(f"shift must be a non-negative integer, got {shift!r}")
        self.shift = shift
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        return f"CrossEntropy(shift={self.shift}, ignore_index={self.ignore_index})"

    def pairs(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(N, C)`` and targets ``(N,)`` compared with each other (ignored ones included)."""
        target = _class_indices(target)
        if self.shift:
            if not isinstance(output, torch.Tensor) or output.dim() < 3 or target.dim() < 2:
                raise ConfigError(
                    f"a shifted cross entropy compares positions along dimension 1: it needs logits (B, T, C) "
                    f"and targets (B, T); got {tuple(getattr(output, 'shape', ()))} and {tuple(target.shape)}"
                )
            output, target = output[:, : -self.shift], target[:, self.shift :]
        return _flat(output, target)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, labels = self.pairs(output, target)
        if labels.numel() and not labels.is_meta and not bool((labels != self.ignore_index).any()):
            return logits.sum() * 0.0  # nothing counts: zero, with a zero gradient (on meta: shapes only)
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index)

    def count(self, output: torch.Tensor, target: torch.Tensor) -> int:
        """The number of targets the mean is over."""
        _, labels = self.pairs(output, target)
        return int((labels != self.ignore_index).sum())

    def accuracy_counts(self, output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
        """``(correct, counted)``: arg-max predictions equal to the targets that count."""
        logits, labels = self.pairs(output, target)
        counted = labels != self.ignore_index
        return int(((logits.argmax(dim=-1) == labels) & counted).sum()), int(counted.sum())


_DEFAULT = CrossEntropy()


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits ``(..., C)`` against integer targets ``(...)`` (targets equal to
    :data:`IGNORE_INDEX` left out): ``CrossEntropy()``."""
    return _DEFAULT(output, target)


cross_entropy.count = _DEFAULT.count  # type: ignore[attr-defined]
cross_entropy.accuracy_counts = _DEFAULT.accuracy_counts  # type: ignore[attr-defined]


def _classifies(output: Any, target: Any) -> bool:
    """Whether ``output`` reads as class scores for ``target``: integer labels ``(...)`` against
    scores ``(..., C)``."""
    return (isinstance(output, torch.Tensor) and class_labels(target)
            and output.dim() == target.dim() + 1 and output.shape[:-1] == target.shape)


def accuracy_counts(output: Any, target: Any, loss_fn: Any = None) -> tuple[int, int] | None:
    """``(correct, counted)`` of one batch, as ``loss_fn`` compares predictions with targets when it
    says (an ``accuracy_counts`` method), else arg-max against every target that counts where the
    output reads as class scores for integer labels; None where there is no accuracy to speak of
    (regression, structured targets, a loss that does not say)."""
    counts = getattr(loss_fn, "accuracy_counts", None)
    if callable(counts):
        return counts(output, target)
    return _DEFAULT.accuracy_counts(output, target) if _classifies(output, target) else None


def target_count(output: Any, target: Any, loss_fn: Any = None) -> int:
    """How many targets ``loss_fn``'s mean is over: its ``count`` method's answer, else the samples
    (a loss that does not say is taken to average over the batch; a structured target's samples
    are its first tensor's rows)."""
    count = getattr(loss_fn, "count", None)
    if callable(count):
        return int(count(output, target))
    first = first_tensor(target)
    return int(first.shape[0]) if first is not None and first.dim() else 1


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
