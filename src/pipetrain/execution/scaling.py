"""The float16 loss scale: one dynamic scale for the whole pipeline, decided by stage 0, and each
stage's part in it.

float16 (``scaler=LossScale(...)``, with ``autocast=torch.float16``): stage 0 stamps each
microbatch with the scale of its update (the same for all microbatches of one update) and the
stamp travels with the forward message (one more tensor after the outputs, taken off by the next
stage); the last stage multiplies the loss by it, every stage divides its gradient by it at the
update (exact: a power of two). Each backward tests the input gradients it sends and the weight
gradients it accumulated, and the backward message carries one more tensor, an overflow flag (the
flag that arrived, or this stage's own finding), so every earlier stage learns of an overflow
before its own update of that microbatch. An update whose gradient overflowed, or that holds a
flagged microbatch, is skipped (as under ``nonfinite="skip"``), and stage 0's scale halves; after
``growth_interval`` clean updates it doubles. docs/gpu.md says which stages agree on a skip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from pipetrain.errors import ConfigError, NonFiniteError, PipetrainError, option
from pipetrain.execution.nonfinite import all_finite
from pipetrain.structure import append, split_last

__all__ = ["LossScale", "StageScale", "as_tuple", "DEFAULT_INIT", "DEFAULT_GROWTH", "MIN_SCALE", "check_power_of_two"]

#: the dynamic scale's first value (``--loss-scale-init``), as torch's GradScaler
DEFAULT_INIT = 2.0 ** 16
#: clean updates after which the dynamic scale doubles (``--loss-scale-growth``), as torch's GradScaler
DEFAULT_GROWTH = 2000
#: a dynamic scale halved below this stops the run: float16's smallest subnormal; the gradient
#: overflows float16 whatever the scale (use bf16)
MIN_SCALE = 2.0 ** -24


def as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def check_power_of_two(named: str, value: float) -> None:
    """Scales are powers of two, so that removing one from a float32 gradient is exact; ``named``: the
    option in the message (:func:`pipetrain.errors.option`)."""
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            and math.frexp(value)[0] == 0.5):
        raise ConfigError(f"{named} must be a power of two such as 65536 or 1024 (removing it from the gradient "
                          f"is then exact), not {value!r}")


@dataclass
class LossScale:
    """The scale stage 0 stamps on each update's microbatches, and how it moves.

    Only stage 0's copy moves (:meth:`update`, once per update, with that update's skip
    decision, which on stage 0 includes every overflow flag that travelled back); the other stages
    use the scale each microbatch's forward message carries. ``dynamic=False``: a fixed scale
    (overflowing updates are still skipped)."""

    init: float = DEFAULT_INIT
    growth_interval: int = DEFAULT_GROWTH
    dynamic: bool = True
    scale: float = field(init=False)
    clean: int = 0  # clean updates since the last change

    def __post_init__(self) -> None:
        self.scale = float(self.init)

    def update(self, overflow: bool, step: int) -> None:
        """After update ``step`` (counted from 1): halve on overflow, double after
        ``growth_interval`` clean updates in a row."""
        if not self.dynamic:
            return
        if overflow:
            self.clean = 0
            self.scale /= 2
            if self.scale < MIN_SCALE:
                raise NonFiniteError(
                    f"stage 0: update {step} overflowed float16 with a loss scale of {self.scale * 2:g}, the "
                    "smallest there is: the gradient is not finite whatever the scale; training stopped there. Use "
                    f"{option('precision', 'bf16')} (float32's range) or lower lr in {option('optimizer')}",
                    stage=0, step=step)
        else:
            self.clean += 1
            if self.clean >= self.growth_interval:
                self.clean = 0
                self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean = float(state["scale"]), int(state["clean"])


class StageScale:
    """One stage's part in the loss scale: the stamps (stage 0), the scale and the overflow of the
    update being accumulated, and per update the scale used and whether it was skipped.

    Args:
        stage: the stage index (stage 0 stamps, the others read the stamps that arrive).
        scaler: the loss scale (only stage 0's moves).
        units_per_update: microbatches per update (one stamp per update).
        device: where the flags and stamps the stage sends are made.
    """

    def __init__(self, stage: int, scaler: LossScale, units_per_update: int, device: torch.device) -> None:
        self.stage = stage
        self.scaler = scaler
        self.units_per_update = units_per_update
        self.device = device
        self.stamps: dict[int, float] = {}  # stage 0: update -> the scale its microbatches carry
        self.overflow = False  # the update being accumulated overflowed (here or later)
        self.pending: float | None = None  # the scale of the update being accumulated
        #: the updates (from 1) skipped because their gradient overflowed, and per update the scale used
        self.overflow_skipped: list[int] = []
        self.scales: list[float] = []

    def received(self, microbatch: int, inputs: Any, stamp: float | None) -> tuple[Any, float]:
        """A forward's inputs and the scale of ``microbatch``: ``stamp`` (a replayed forward), stage
        0's own stamp, or the one stage 0 put after the outputs (taken off the inputs)."""
        if stamp is not None:
            return inputs, stamp
        if self.stage == 0:
            return inputs, self._stamp(microbatch)
        inputs, carried = split_last(as_tuple(inputs))
        return inputs, float(carried)

    def _stamp(self, microbatch: int) -> float:
        """Stage 0: the scale of ``microbatch``'s update, fixed at the first forward of that update
        (so every microbatch of an update carries the same scale, wherever it is accumulated)."""
        update = microbatch // self.units_per_update
        scale = self.stamps.get(update)
        if scale is None:
            scale = self.stamps[update] = self.scaler.scale
            for old in [u for u in self.stamps if u < update - 64]:
                del self.stamps[old]
        return scale

    def sent(self, outputs: Any, scale: float) -> Any:
        """A forward's outputs with the stamp after them."""
        return append(outputs, torch.tensor([scale], dtype=torch.float32, device=self.device))

    def arrived(self, microbatch: int, scale: float, grad_outputs: tuple | None) -> tuple[Any, bool]:
        """The gradients that arrived for a backward of ``microbatch`` (stamped ``scale``) and the
        overflow flag after them (taken off; none on the last stage). The update's scale must be
        the microbatch's."""
        if self.pending is None:
            self.pending = scale
        elif self.pending != scale:
            raise PipetrainError(f"stage {self.stage}: microbatch {microbatch} carries loss scale {scale:g} "
                                 f"but the update it joins has {self.pending:g}")
        if grad_outputs is None:
            return None, False
        *grads, flag = grad_outputs
        return tuple(grads), bool(flag.item())

    def test(self, leaves: Iterable[Tensor], flagged: bool, grads: Sequence, weights: bool) -> None:
        """Whether the update being accumulated overflowed, from the flag that arrived, the input
        gradients about to be sent and (``weights``) the weight gradients accumulated on ``leaves``.
        An overflow also puts an infinity in an accumulated weight gradient, so that a replica's
        SYNC (or a tied parameter's sum) carries it to the others."""
        if self.overflow:
            return
        leaves = list(leaves)
        tested = [g for g in grads if isinstance(g, Tensor)]
        if weights:
            tested += [leaf.grad for leaf in leaves if leaf.grad is not None]
        if flagged or not all_finite(tested):  # one test, one host read
            self.overflow = True
            for leaf in leaves:
                if leaf.grad is not None:
                    leaf.grad.view(-1)[:1] = math.inf
                    break

    def flagged(self, grads: tuple) -> tuple:
        """The gradients to send back, with the overflow flag after them (not from stage 0)."""
        if self.stage == 0:
            return grads
        return grads + (torch.tensor([1.0 if self.overflow else 0.0], dtype=torch.float32, device=self.device),)

    def sent_back(self, leaves: Iterable[Tensor], flagged: bool, grads: tuple) -> tuple:
        """After a full backward: the update tested (the weight gradients on ``leaves`` too), and
        the input gradients to send with the flag."""
        self.test(leaves, flagged, grads, weights=True)
        return self.flagged(grads)

    def sent_back_by_input_half(self, leaves: Iterable[Tensor], flagged: bool, grads: tuple) -> tuple:
        """After the I half of a split backward: a flag that arrived is kept (the W half records it
        in the weight gradient), the input gradients tested and sent with the flag."""
        if flagged:
            self.overflow = True
        self.test(leaves, False, grads, weights=False)
        return self.flagged(grads)

    def tested_by_weight_half(self, leaves: Iterable[Tensor]) -> None:
        """After the W half: the weight gradients on ``leaves`` tested (an overflow found only
        here reaches no earlier stage, docs/gpu.md)."""
        overflow, self.overflow = self.overflow, False
        self.test(leaves, overflow, (), weights=True)

    def share(self, overflow: bool) -> None:
        """SYNC: ``overflow`` says whether any replica's part of the update overflowed, so that every
        replica skips it. The infinity written into the gradient carries it too, but a stage without
        trainable weights has no gradient to carry it (and stage 0's replicas must agree: each moves
        its own copy of the scale)."""
        if overflow:
            self.overflow = True

    def finish(self, step: int, grads: Mapping[str, Tensor],
               check_skip_limit: Callable[[list[int], int, Mapping[str, Tensor]], None]) -> tuple[bool, float]:
        """At update ``step`` (from 1): whether it is skipped (its gradient overflowed here or
        later) and the factor that removes its scale; stage 0's scale moves. A fixed scale that
        keeps overflowing stops the run (``check_skip_limit``)."""
        overflow = self.overflow or not all_finite(list(grads.values()))
        # an update with no backward here has nothing to unscale: stage 0's scale, else 1
        scale = self.pending if self.pending is not None else (self.scaler.scale if self.stage == 0 else 1.0)
        self.overflow, self.pending = False, None
        self.scales.append(scale)
        if overflow:
            self.overflow_skipped.append(step)
            if not self.scaler.dynamic:
                check_skip_limit(self.overflow_skipped, step, grads)
        if self.stage == 0:
            self.scaler.update(overflow, step)
        return overflow, 1.0 / scale

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "stamps": dict(self.stamps), "overflow": self.overflow,
                "pending_scale": self.pending, "overflow_skipped": list(self.overflow_skipped),
                "scales": list(self.scales)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.stamps = dict(state["stamps"])
        self.overflow, self.pending = state["overflow"], state["pending_scale"]
        self.overflow_skipped, self.scales = list(state["overflow_skipped"]), list(state["scales"])
