"""SGD with momentum, dampening, Nesterov and weight decay as in torch.optim.SGD, plus SC (and
its rate-following time-scaled variant)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pipetrain.errors import ConfigError
from pipetrain.optim import fused
from pipetrain.optim.base import StageOptimizer
from pipetrain.optim.compensation import rate_following_settings, spike_coefficients
from pipetrain.optim.lr_schedule import LRSchedule

__all__ = ["SGD", "RateFollowingSGD"]


class SGD(StageOptimizer):
    """``torch.optim.SGD`` (single-tensor path, bitwise) as an out-of-place stage optimizer.

    With ``g = grad + weight_decay * w`` and buffer ``v`` (set to ``g`` on the first update, then
    ``v <- momentum*v + (1 - dampening)*g``) the update is ``w <- w - lr*d`` with direction

    * ``d = v`` (plain momentum), ``d = g + momentum*v`` (``nesterov=True``), ``d = g`` (no
      momentum);
    * Spike Compensation with delay ``sc_delay = D > 0``: ``d = a*v + (1 - dampening)*b*g`` with
      ``(a, b) = spike_coefficients(momentum, D)``. Weight decay is part of ``g`` (as in torch's
      Nesterov); dampening scales the spike like every other term of the momentum response, so
      the spike is still the sum of the D missing terms. D=1 (no dampening) is computed with the
      very same operations as ``nesterov=True``, so the two agree bitwise.

    Without momentum no buffer is kept; :meth:`velocity` is then the last gradient if
    ``lwp_horizon > 0`` (``v = g`` is the ``m = 0`` case of ``v <- m*v + g``), else unavailable.
    """

    name = "sgd"

    def __init__(
        self,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        sc_delay: float = 0.0,
        lwp_horizon: float = 0.0,
        lr_schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(lr, lr_schedule=lr_schedule, lwp_horizon=lwp_horizon)
        if not momentum >= 0.0:
            raise ConfigError(f"momentum={momentum} must be >= 0")
        if not weight_decay >= 0.0:
            raise ConfigError(f"weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("nesterov=true needs momentum > 0 and dampening=0")
        if sc_delay and nesterov:
            raise ConfigError(
                "spike compensation replaces Nesterov momentum (SC with delay 1 *is* Nesterov); "
                "use nesterov=false with compensation sc"
            )
        if sc_delay and momentum > 1.0:
            raise ConfigError(f"spike compensation needs momentum <= 1, got {momentum}")
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.sc_delay = float(sc_delay)
        a, b = spike_coefficients(self.momentum, self.sc_delay) if self.sc_delay else (1.0, 0.0)
        self._spike_a = a
        self._spike_b = b * (1.0 - self.dampening)
        self._keep_last_grad = self.momentum == 0.0 and self.lwp_horizon > 0.0
        self._scratch = fused.Scratch()

    @property
    def state_slots(self) -> int:
        return 1 if self.momentum != 0.0 or self._keep_last_grad else 0

    def _update(self, name: str, param: Tensor, grad: Tensor, lr: float, out: Tensor | None = None) -> Tensor:
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum == 0:
            if self._keep_last_grad:
                self.state[name] = {"momentum_buffer": grad.clone()}
            return torch.add(param, grad, alpha=-lr, out=out)

        slots = self.state.setdefault(name, {})
        buf = slots.get("momentum_buffer")
        if buf is None:
            buf = grad.clone()
            slots["momentum_buffer"] = buf
        else:
            buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)

        if self.nesterov:
            direction = grad.add(buf, alpha=self.momentum)
        elif self.sc_delay == 0.0:  # plain momentum (SC with D = 0 is the same)
            direction = buf
        elif self._spike_b == 1.0:  # same ops as Nesterov when D = 1
            direction = grad.add(buf, alpha=self._spike_a)
        else:
            direction = grad.mul(self._spike_b).add_(buf, alpha=self._spike_a)
        return torch.add(param, direction, alpha=-lr, out=out)

    def _update_all(self, names, params, grads, lr, outs):
        """:meth:`_update` for every parameter, its ops batched (see :mod:`pipetrain.optim.fused`)."""
        if self.weight_decay != 0:
            grads = fused.add_into(self._scratch.get("decayed", names, grads), grads, params, self.weight_decay)
        if self.momentum == 0:
            if self._keep_last_grad:
                for name, grad in zip(names, grads):
                    slots = self.state.get(name)
                    if slots is None:
                        self.state[name] = {"momentum_buffer": grad.clone()}
                    else:
                        slots["momentum_buffer"].copy_(grad)
            return fused.add_into(outs, params, grads, -lr)

        bufs, old_bufs, old_grads = [], [], []
        for name, grad in zip(names, grads):
            slots = self.state.setdefault(name, {})
            buf = slots.get("momentum_buffer")
            if buf is None:
                buf = slots["momentum_buffer"] = grad.clone()
            else:
                old_bufs.append(buf)
                old_grads.append(grad)
            bufs.append(buf)
        if old_bufs:
            torch._foreach_mul_(old_bufs, self.momentum)
            torch._foreach_add_(old_bufs, old_grads, alpha=1 - self.dampening)

        if self.nesterov:
            directions = fused.add_into(self._scratch.get("direction", names, grads), grads, bufs, self.momentum)
        elif self.sc_delay == 0.0:
            directions = bufs
        elif self._spike_b == 1.0:
            directions = fused.add_into(self._scratch.get("direction", names, grads), grads, bufs, self._spike_a)
        else:
            directions = fused.mul_into(self._scratch.get("direction", names, grads), grads, self._spike_b)
            torch._foreach_add_(directions, bufs, alpha=self._spike_a)
        return fused.add_into(outs, params, directions, -lr)

    def velocity(self, name: str) -> Tensor | None:
        slots = self.state.get(name)
        return None if slots is None else slots.get("momentum_buffer")

    def _check_can_predict(self) -> None:
        if self.momentum == 0.0 and not self._keep_last_grad:
            raise ConfigError(
                "this SGD has no momentum and keeps no velocity to predict with; build it with "
                "lwp_horizon > 0 (compensation lwp) so that it keeps the last gradient"
            )

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "dampening": self.dampening,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
            "sc_delay": self.sc_delay,
            "lwp_horizon": self.lwp_horizon,
            "lr_schedule": repr(self.lr_schedule),
        }


class RateFollowingSGD(SGD):
    """:class:`SGD` of a stage under rate-following delay time scaling (``dtsf``, docs/optim.md).

    Before every update (and every LWP prediction) the stage takes the ``(lr factor, momentum)`` of
    :func:`~pipetrain.optim.compensation.rate_following_settings` for the lr schedule's factor at
    that moment: DTS's ``1/k**2`` and ``1 - (1 - m)/k`` with ``k = max(1, (D/D*)*sqrt(f))``, so the
    stage returns to SGD's rate and memory as the schedule decays. The update itself is
    :class:`SGD`'s with those numbers (SC's coefficients from the momentum in force). ``momentum``
    is the base momentum ``m``; ``stage_delay`` is ``D`` and ``reference_delay`` ``D*``.
    """

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, stage_delay: float,
                 reference_delay: float, sc_delay: float = 0.0, lwp_horizon: float = 0.0,
                 lr_schedule: LRSchedule | None = None) -> None:
        super().__init__(lr, momentum, dampening, weight_decay, nesterov, sc_delay=sc_delay,
                         lwp_horizon=lwp_horizon, lr_schedule=lr_schedule)
        if nesterov:
            raise ConfigError("rate-following delay time scaling (dtsf) is defined for plain momentum, not Nesterov")
        rate_following_settings(momentum, stage_delay, 1.0, reference_delay)  # checks the arguments
        self.base_momentum = float(momentum)
        self.stage_delay = float(stage_delay)
        self.reference_delay = float(reference_delay)
        self._factor = math.nan  # the schedule factor whose settings were last taken (none yet)
        self._settings = self.settings_for(1.0)

    def settings_for(self, factor: float) -> tuple[float, float, float, float]:
        """``(lr factor, momentum, a, b)`` at lr schedule factor ``factor``: the pair of
        :func:`~pipetrain.optim.compensation.rate_following_settings` and SC's coefficients for
        that momentum (``(1, 0)`` without SC). The batched PB engine reads its table from it."""
        if factor != self._factor:
            lr_factor, momentum = rate_following_settings(self.base_momentum, self.stage_delay, factor,
                                                          self.reference_delay)
            a, b = spike_coefficients(momentum, self.sc_delay) if self.sc_delay else (1.0, 0.0)
            self._factor, self._settings = factor, (lr_factor, momentum, a, b)
        return self._settings

    def lr_at(self, samples_seen: int) -> float:
        factor = self.settings_for(self.lr_schedule.factor(samples_seen))[0]
        lr = self.lr_schedule.lr_at(samples_seen, self.lr)
        return lr if factor == 1.0 else lr * factor

    def step(self, params, grads, samples_seen: int, *, out=None):
        _, momentum, a, b = self.settings_for(self.lr_schedule.factor(samples_seen))
        self.momentum, self._spike_a, self._spike_b = momentum, a, b * (1.0 - self.dampening)
        return super().step(params, grads, samples_seen, out=out)

    def hyperparameters(self) -> dict[str, Any]:
        values = super().hyperparameters()
        values["momentum"] = self.base_momentum
        values["stage_delay"] = self.stage_delay
        values["reference_delay"] = self.reference_delay
        return values
