"""What a stage does with NaN or infinite values (``nonfinite=``), tested where it costs nothing on the
way.

The last stage tests each microbatch's loss (a number every executor reads anyway) and a NaN or
infinite one stops the run (``stop``, the default; a non-finite gradient makes the weights
non-finite, and so the next loss that goes through them); checkpoints and saved models refuse
weights that are not finite (:meth:`NonFiniteGuard.check_weights`), so that none holds them. With
``skip`` every update tests its gradient first (one pass over it and one read of the host, the
price of skipping) and leaves the weights as they are when it is not finite: the update still makes
a version, equal to the last, and the optimizer's state does not move. docs/optim.md says what
``skip`` means for each schedule.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import Tensor

from pipetrain.errors import NonFiniteError, PipetrainError, option
from pipetrain.execution.failures import PLAIN, StageNames
from pipetrain.execution.version_store import VersionStore

__all__ = ["NONFINITE", "SKIP_LIMIT", "NonFiniteGuard", "all_finite", "nonfinite_kind", "nonfinite_names",
           "advice", "finite_loss"]

#: What a stage does with a NaN or infinite loss or gradient: ``stop`` the run (the default),
#: ``skip`` the update (keep the weights), or ``off`` (no test; for measuring what the tests cost).
NONFINITE = ("stop", "skip", "off")
#: Under ``skip``, a stage that skips this many updates in a row stops the run: its weights (or
#: the data) keep producing non-finite values, and the run would otherwise end with weights that
#: no update has moved for a long time, as if it had succeeded.
SKIP_LIMIT = 10


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite, with one read of the host (not one per
    tensor): the sum of the tensors' sums is NaN or infinite when any value is. Finite values
    beyond about 1e38 can overflow that sum too, so a failed test is confirmed tensor by tensor."""
    if not tensors:
        return True
    total = torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()
    if math.isfinite(total.item()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def finite_loss(loss: Tensor) -> bool:
    """Whether every value of ``loss`` is finite (one number: one read of the host)."""
    return math.isfinite(loss.item()) if loss.numel() == 1 else bool(torch.isfinite(loss).all())


def nonfinite_kind(tensor: Tensor) -> str | None:
    """``"nan"``, ``"inf"`` (either sign) or ``None`` when every value is finite."""
    if bool(torch.isnan(tensor).any()):
        return "nan"
    return None if bool(torch.isfinite(tensor).all()) else "inf"


def nonfinite_names(tensors: Mapping[str, Tensor]) -> str:
    """``"2.weight (nan), 2.bias (inf)"``: the non-finite tensors, at most three named."""
    bad = [(name, kind) for name, t in tensors.items() if (kind := nonfinite_kind(t)) is not None]
    text = ", ".join(f"{name} ({kind})" for name, kind in bad[:3])
    return text + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def advice(skip: bool) -> str:
    """What to change, appended to every non-finite message."""
    text = (
        "A loss or gradient that is not finite usually comes from a learning rate too large for the model "
        f"(lower lr in {option('optimizer')}) or from NaN or infinite values in the data"
    )
    if skip:
        text += f"; {option('on_nonfinite', 'skip')} drops an update whose gradient is not finite instead of stopping"
    return text


class NonFiniteGuard:
    """One stage's tests under ``mode`` (one of :data:`NONFINITE`), and the updates it skipped."""

    def __init__(self, stage: int, mode: str, names: StageNames = PLAIN) -> None:
        if mode not in NONFINITE:
            raise PipetrainError(f"nonfinite must be one of {', '.join(NONFINITE)}, not {mode!r}")
        self.stage = stage
        self.names = names  # how messages name this stage and the one before it
        self.mode = mode
        #: the updates (counted from 1) skipped because their gradient was not finite (``skip``)
        self.skipped: list[int] = []

    def check_loss(self, microbatch: int, loss: Tensor, inputs: tuple, weights: Mapping[str, Tensor]) -> None:
        """Under ``stop``, stop at a loss that is not finite, saying where it came from."""
        if self.mode == "stop" and not finite_loss(loss):
            raise NonFiniteError(
                f"{self.names(self.stage)}: the loss of microbatch {microbatch} is {nonfinite_kind(loss)}"
                f"{self._origin(inputs, weights)}; training stopped there. {advice(skip=True)}",
                stage=self.stage, microbatch=microbatch,
            )

    def _origin(self, inputs: tuple, weights: Mapping[str, Tensor]) -> str:
        """Where a non-finite loss came from, as far as this stage can tell (the error path only)."""
        bad = [kind for x in inputs if isinstance(x, Tensor) and x.is_floating_point()
               and (kind := nonfinite_kind(x)) is not None]
        if bad:
            return f" (its input from {self.names.input_of(self.stage)} already holds {bad[0]})"
        if not all_finite(list(weights.values())):
            return f" (the weights of this stage are not finite in {nonfinite_names(weights)})"
        return " (its input and weights are finite: its own computation overflowed)"

    def skips(self, step: int, grads: Mapping[str, Tensor]) -> bool:
        """Under ``skip``: whether update ``step`` (from 1) is skipped, its gradient not finite."""
        skip = self.mode == "skip" and not all_finite(list(grads.values()))
        if skip:
            self.skipped.append(step)
            self.check_skip_limit(self.skipped, step, grads)
        return skip

    def check_skip_limit(self, skipped: list[int], step: int, grads: Mapping[str, Tensor]) -> None:
        """Stop after :data:`SKIP_LIMIT` skipped updates in a row (see its docstring)."""
        if len(skipped) >= SKIP_LIMIT and skipped[-SKIP_LIMIT] == step - SKIP_LIMIT + 1:
            raise NonFiniteError(
                f"{self.names(self.stage)}: the gradients of updates {step - SKIP_LIMIT + 1} to {step} were all not "
                f"finite (the last in {nonfinite_names(grads)}) and all were skipped: the weights or the data "
                f"keep producing NaN or infinite values; training stopped there. {advice(skip=False)}",
                stage=self.stage, step=step,
            )

    def check_weights(self, versions: VersionStore, consequence: str) -> None:
        """Raise a :class:`~pipetrain.errors.NonFiniteError` if a held weight version is not finite
        (one pass over each, for checkpoints and the end of a run; not with ``off``)."""
        if self.mode == "off":
            return
        for version in versions.held():
            params = versions[version]
            if not all_finite(list(params.values())):
                raise NonFiniteError(
                    f"{self.names(self.stage)}: the weights after update {version} are not finite in "
                    f"{nonfinite_names(params)}; {consequence}. {advice(skip=self.mode == 'stop')}",
                    stage=self.stage, step=version,
                )
