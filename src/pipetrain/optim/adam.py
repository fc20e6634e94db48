"""Adam and AdamW as in torch.optim.Adam/AdamW (single-tensor path, bitwise), out of place."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipetrain.errors import ConfigError
from pipetrain.optim import fused
from pipetrain.optim.base import StageOptimizer
from pipetrain.optim.lr_schedule import LRSchedule

__all__ = ["Adam", "AdamW"]


class Adam(StageOptimizer):
    """``torch.optim.Adam`` (``foreach=False``) as an out-of-place stage optimizer.

    Per parameter, with step count t (counted per parameter, as torch does):
    ``g = grad + weight_decay*w`` (coupled decay; AdamW instead multiplies ``w`` by
    ``1 - lr*weight_decay``), ``m <- lerp(m, g, 1 - beta1)``, ``s <- beta2*s + (1 - beta2)*g*g``,
    ``w <- w - lr/(1 - beta1**t) * m / (sqrt(s)/sqrt(1 - beta2**t) + eps)``; with ``amsgrad``
    the running maximum of ``s`` replaces ``s`` in the denominator.

    The step count is a Python int where torch keeps a float32 tensor: identical up to 2**24
    steps, after which torch's counter stops growing and this one stays exact.

    Linear Weight Prediction uses the Adam step direction: :meth:`velocity` is the update of the
    latest step per unit learning rate, ``m_hat/(sqrt(s_hat) + eps)`` from the current moments
    (AdamW adds its decoupled decay, see :class:`AdamW`). Spike Compensation is defined for
    momentum SGD only and is refused for Adam by
    :func:`~pipetrain.optim.spec.build_stage_optimizer`.
    """

    name = "adam"
    decoupled_weight_decay = False

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        lwp_horizon: float = 0.0,
        lr_schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(lr, lr_schedule=lr_schedule, lwp_horizon=lwp_horizon)
        beta1, beta2 = betas
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"betas[{index}]={beta} must lie in [0, 1), e.g. betas=0.9/0.999")
        if not eps >= 0.0:
            raise ConfigError(f"eps={eps} must be >= 0")
        if not weight_decay >= 0.0:
            raise ConfigError(f"weight_decay={weight_decay} must be >= 0")
        self.betas = (float(beta1), float(beta2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.amsgrad = bool(amsgrad)
        self._scratch = fused.Scratch()

    @property
    def state_slots(self) -> int:
        return 3 if self.amsgrad else 2

    def _slots(self, name: str, param: Tensor) -> dict:
        """The moments of ``name`` (zeros, step 0, at its first update), as torch.optim.Adam keeps them."""
        slots = self.state.get(name)
        if slots is None:
            zeros = lambda: torch.zeros_like(param, memory_format=torch.preserve_format)  # noqa: E731
            slots = {"step": 0, "exp_avg": zeros(), "exp_avg_sq": zeros()}
            if self.amsgrad:
                slots["max_exp_avg_sq"] = zeros()
            self.state[name] = slots
        return slots

    def _update(self, name: str, param: Tensor, grad: Tensor, lr: float, out: Tensor | None = None) -> Tensor:
        beta1, beta2 = self.betas
        slots = self._slots(name, param)
        slots["step"] += 1
        step = float(slots["step"])

        if self.weight_decay != 0:
            if self.decoupled_weight_decay:
                param = param.mul(1 - lr * self.weight_decay)
            else:
                grad = grad.add(param, alpha=self.weight_decay)

        exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        second = exp_avg_sq
        if self.amsgrad:
            second = slots["max_exp_avg_sq"]
            torch.maximum(second, exp_avg_sq, out=second)
        denom = (second.sqrt() / bias_correction2_sqrt).add_(self.eps)
        return torch.addcdiv(param, exp_avg, denom, value=-step_size, out=out)

    def _update_all(self, names, params, grads, lr, outs):
        """:meth:`_update` for every parameter, its ops batched (see :mod:`pipetrain.optim.fused`);
        the denominators go into reused scratch tensors instead of new ones."""
        beta1, beta2 = self.betas
        exp_avgs, exp_avg_sqs, maxima, step_sizes, corrections = [], [], [], [], []
        for name, param in zip(names, params):
            slots = self._slots(name, param)
            slots["step"] += 1
            step = float(slots["step"])
            exp_avgs.append(slots["exp_avg"])
            exp_avg_sqs.append(slots["exp_avg_sq"])
            if self.amsgrad:
                maxima.append(slots["max_exp_avg_sq"])
            step_sizes.append(-(lr / (1 - beta1**step)))
            corrections.append((1 - beta2**step) ** 0.5)

        if self.weight_decay != 0:
            if self.decoupled_weight_decay:
                params = outs = fused.mul_into(outs, params, 1 - lr * self.weight_decay)
            else:
                grads = fused.add_into(self._scratch.get("decayed", names, grads), grads, params, self.weight_decay)

        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        second = exp_avg_sqs
        if self.amsgrad:
            torch._foreach_maximum_(maxima, exp_avg_sqs)
            second = maxima
        denominators = self._scratch.get("denominator", names, params)
        torch._foreach_copy_(denominators, second)
        torch._foreach_sqrt_(denominators)
        torch._foreach_div_(denominators, corrections)
        torch._foreach_add_(denominators, self.eps)
        return fused.addcdiv_into(outs, params, exp_avgs, denominators, step_sizes)

    def velocity(self, name: str) -> Tensor | None:
        """The Adam step per unit learning rate, in a scratch tensor of this optimizer (rewritten by
        the next call for ``name``: use it before, or clone it)."""
        slots = self.state.get(name)
        if slots is None:
            return None
        beta1, beta2 = self.betas
        step = float(slots["step"])
        second = slots["max_exp_avg_sq"] if self.amsgrad else slots["exp_avg_sq"]
        exp_avg = slots["exp_avg"]
        denom, velocity = (self._scratch.get(slot, [name], [exp_avg])[0] for slot in ("velocity_denominator", "velocity"))
        # the ops of (second.sqrt() / sqrt(1 - beta2**t)).add_(eps), then exp_avg / denom / (1 - beta1**t)
        torch.sqrt(second, out=denom)
        denom.div_((1 - beta2**step) ** 0.5).add_(self.eps)
        return torch.div(exp_avg, denom, out=velocity).div_(1 - beta1**step)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "amsgrad": self.amsgrad,
            "lwp_horizon": self.lwp_horizon,
            "lr_schedule": repr(self.lr_schedule),
        }


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay ``w <- w*(1 - lr*weight_decay)``.

    Its prediction extrapolates that decay linearly as well:
    ``w_hat = w*(1 - lr*T*weight_decay) - lr*T*velocity``.
    """

    name = "adamw"
    decoupled_weight_decay = True

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        lwp_horizon: float = 0.0,
        lr_schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(
            lr, betas, eps, weight_decay, amsgrad, lwp_horizon=lwp_horizon, lr_schedule=lr_schedule
        )

    def _predict_one(self, name: str, param: Tensor, lr_horizon: float, out: Tensor | None = None) -> Tensor | None:
        velocity = self.velocity(name)
        if velocity is None:
            return None
        if self.weight_decay != 0:
            param = torch.mul(param, 1 - lr_horizon * self.weight_decay, out=out)
            return param.add_(velocity, alpha=-lr_horizon)
        return torch.add(param, velocity, alpha=-lr_horizon, out=out)
