"""The update of a one-microbatch step applied during its backward, parameter by parameter.

A stage that updates after every microbatch (one microbatch per update) on one weight version
(the ``flush`` policy) needs each weight gradient only until the update has read it. Applied as
soon as autograd has finished a parameter's gradient (a post-accumulate-grad hook), the update
frees that gradient at once, so the stage never holds its whole gradient: its memory is its
weights, one parameter's gradient and the activations, instead of twice its weights. Each
parameter's update is the optimizer's own single-tensor arithmetic (``StageOptimizer._update``,
op for op what its batched form computes) at the learning rate of the update, written into the
version's own tensors: bitwise the result of updating after the backward.

It applies only where that is exact and nothing else needs the whole gradient: no replicas (their
SYNC sums gradients), no parameter shared with another stage (summed before the update), no
float16 loss scale or ``on_nonfinite="skip"`` (both test the whole gradient first), a full
backward (not a split one), pipetrain's own optimizers, and a microbatch whose version nothing
else reads (:meth:`UpdateInBackward.applies`); otherwise the stage accumulates as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipetrain.optim.base import StageOptimizer

__all__ = ["UpdateInBackward", "can_update_in_backward", "fused_update", "update_wanted"]


def can_update_in_backward(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates each parameter alone, as its ``step`` would (pipetrain's own
    optimizers, unless a subclass changes what ``step`` does)."""
    return isinstance(optimizer, StageOptimizer) and type(optimizer).step is StageOptimizer.step


def update_wanted(allowed: bool, units_per_update: int, scaler: Any, nonfinite: str) -> bool:
    """Whether a stage wants its update made during the backward: ``allowed`` by the run (one
    weight version, no replicas, no shared parameter), one microbatch per update, and nothing that
    must see the whole gradient first (a loss scale's overflow check, ``nonfinite="skip"``)."""
    return allowed and units_per_update == 1 and scaler is None and nonfinite != "skip"


def fused_update(optimizer: Any, wanted: bool) -> UpdateInBackward | None:
    """The hooks for a stage that may update in its backward (``wanted``: the caller knows nothing
    else needs the whole gradient), when ``optimizer`` can; ``None`` otherwise."""
    return UpdateInBackward(optimizer) if wanted and can_update_in_backward(optimizer) else None


class UpdateInBackward:
    """Hooks that update a stage's current version during the backward of its update's only
    microbatch; :attr:`applied` tells the next ``step`` that its update is made."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.applied = False

    def applies(self, versions: Any, version: int, others_in_flight: bool, names: list[str]) -> bool:
        """Whether the backward of a microbatch that read ``version`` may update in place: it is
        the current version, no other microbatch in flight reads it, and no other version shares
        its tensors."""
        return (version == versions.current and not others_in_flight
                and all(versions.exclusive(version, name) for name in names))

    def hook(self, leaves: dict[str, Tensor], current: dict[str, Tensor], samples_seen: int) -> list[Any]:
        """Register the hooks on ``leaves`` (the autograd leaves of ``current``'s tensors); returns
        their handles, to be removed after the backward."""
        optimizer = self.optimizer
        lr = optimizer.lr_at(samples_seen)

        def update(name: str):
            def apply(leaf: Tensor) -> None:
                grad, leaf.grad = leaf.grad, None
                with torch.no_grad():
                    target = current[name]
                    optimizer._update(name, target, grad, lr, target)

            return apply

        self.applied = True
        return [leaf.register_post_accumulate_grad_hook(update(name)) for name, leaf in leaves.items()]

    def finish(self) -> None:
        """The update is made (its ``step`` counts it)."""
        self.applied = False
        self.optimizer.steps += 1
