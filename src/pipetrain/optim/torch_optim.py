"""``torch.optim`` optimizers and learning-rate schedulers on versioned pipeline stages.

A user hands the Python API an optimizer class and its arguments, as they would to a plain
training loop. pipetrain runs one per stage replica, and on versioned schedules (PipeDream's
stashed weights, 2BW, PB) it must never update a tensor that a stashed version or autograd still
holds. Two routes:

* ``torch.optim.SGD``, ``Adam`` and ``AdamW`` with their usual arguments become pipetrain's own
  functional optimizers (:func:`as_spec`): those repeat torch's single-tensor arithmetic op for
  op, so results are bitwise torch's, and they support Spike Compensation and Linear Weight
  Prediction.
* Any other ``torch.optim.Optimizer`` runs as itself inside :class:`TorchOptimizer`: before each
  update its parameter slots are pointed at the tensors that receive the new weights (the old
  version's tensors when nothing reads them any more, else copies of them in the tensors of a
  released version or in fresh ones), so the old version stays intact. Its state moves with the
  slots.

A ``torch.optim.lr_scheduler`` is given as ``lr_scheduler(optimizer) -> scheduler`` and stepped
once per update of each stage (:class:`SchedulerLR` drives pipetrain's own optimizers with it).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.optim.base import StageOptimizer
from pipetrain.optim.spec import OPTIMIZERS, OptimizerSpec

__all__ = ["as_spec", "TorchOptimizer", "SchedulerLR", "SchedulerFactory", "is_torch_optimizer"]

#: ``lr_scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler``
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

_OWN = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: arguments whose value here selects torch's default single-tensor arithmetic (what ours repeats)
_DEFAULTS = {"foreach": (None, False), "maximize": (False,), "capturable": (False,), "differentiable": (False,),
             "fused": (None, False)}


def is_torch_optimizer(value: Any) -> bool:
    """Whether ``value`` is a ``torch.optim.Optimizer`` subclass (not an instance)."""
    return isinstance(value, type) and issubclass(value, torch.optim.Optimizer)


def as_spec(cls: type, options: Mapping[str, Any]) -> OptimizerSpec | None:
    """pipetrain's own equivalent of ``cls(**options)`` (bitwise the same arithmetic), or None when
    there is none (another class, or an argument such as ``foreach=True`` that changes it)."""
    name = _OWN.get(cls)
    if name is None:
        return None
    valid = OPTIMIZERS[name][1]
    kept: dict[str, Any] = {}
    for key, value in options.items():
        if key in valid:
            kept[key] = tuple(float(v) for v in value) if key == "betas" else value
        elif key not in _DEFAULTS or value not in _DEFAULTS[key]:
            return None
    return OptimizerSpec(name, kept)


class TorchOptimizer(StageOptimizer):
    """A ``torch.optim.Optimizer`` class run as a functional stage optimizer (see the module
    docstring). ``scheduler``: ``lr_scheduler(optimizer)``, stepped after every update."""

    name = "torch"

    def __init__(self, cls: type, options: Mapping[str, Any], scheduler: SchedulerFactory | None = None) -> None:
        super().__init__(float(options.get("lr", 0.0)) if isinstance(options.get("lr", 0.0), (int, float)) else 0.0)
        self._cls, self._options, self._scheduler_factory = cls, dict(options), scheduler
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._names: list[str] = []
        self._pending_state: Mapping[str, Any] | None = None

    @property
    def state_slots(self) -> int:
        if self._optimizer is None or not self._optimizer.state:
            return 0
        return max(sum(isinstance(v, Tensor) and v.dim() > 0 for v in s.values()) for s in self._optimizer.state.values())

    def _build(self, params: Mapping[str, Tensor]) -> torch.optim.Optimizer:
        self._names = list(params)
        try:
            optimizer = self._cls([params[n] for n in self._names], **self._options)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{self._cls.__name__}({self._describe()}) failed: {error}") from None
        if len(optimizer.param_groups) != 1:
            raise ConfigError(f"{self._cls.__name__}: pipetrain gives a stage's parameters as one group")
        self._optimizer = optimizer
        if self._scheduler_factory is not None:
            self._scheduler = self._scheduler_factory(optimizer)
        if self._pending_state is not None:
            self._load(self._pending_state)
            self._pending_state = None
        return optimizer

    def _describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._options.items())

    def step(
        self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor | None], samples_seen: int, *,
        out: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        unknown = [name for name in grads if name not in params]
        if unknown:
            raise PipetrainError(f"gradients for unknown parameters {unknown}; the stage's parameters are {list(params)}")
        optimizer = self._optimizer if self._optimizer is not None else self._build(params)
        slots = optimizer.param_groups[0]["params"]
        updated: dict[str, Tensor] = {}
        with torch.no_grad():
            for index, name in enumerate(self._names):
                grad = grads.get(name)
                if grad is None:
                    updated[name] = params[name]
                    continue
                target = None if out is None else out.get(name)
                if target is None:
                    target = params[name].detach().clone()
                elif target is not params[name]:  # a released version's tensor: the update starts from params
                    target.copy_(params[name])
                old = slots[index]
                if old is not target:  # the slot (and the optimizer's state) follows the new tensor
                    slots[index] = target
                    if old in optimizer.state:
                        optimizer.state[target] = optimizer.state.pop(old)
                target.grad = grad.detach()
                updated[name] = target
            optimizer.step()
            for name in updated:
                updated[name].grad = None
        if self._scheduler is not None:
            self._scheduler.step()
        self.steps += 1
        return updated

    def _update(self, name: str, param: Tensor, grad: Tensor, lr: float, out: Tensor | None = None) -> Tensor:
        raise NotImplementedError  # step() is overridden as a whole

    def velocity(self, name: str) -> Tensor | None:
        return None

    def _check_can_predict(self) -> None:
        raise ConfigError(
            f"Linear Weight Prediction needs pipetrain's own SGD, Adam or AdamW; {self._cls.__name__} keeps no "
            "velocity it can extrapolate"
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"class": f"{self._cls.__module__}.{self._cls.__qualname__}", **{k: repr(v) for k, v in self._options.items()}}

    def state_bytes(self) -> int:
        if self._optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self._optimizer.state.values() for v in s.values()
                   if isinstance(v, Tensor))

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "steps": self.steps,
            "hyperparameters": self.hyperparameters(),
            "torch": None if self._optimizer is None else _clone(self._optimizer.state_dict()),
            "scheduler": None if self._scheduler is None else _clone(self._scheduler.state_dict()),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict.get("optimizer") != self.name or state_dict.get("hyperparameters") != self.hyperparameters():
            raise ConfigError(
                f"cannot load the optimizer state of {state_dict.get('hyperparameters')} into {self.hyperparameters()}; "
                "resume with the optimizer the checkpoint was written with"
            )
        self.steps = int(state_dict["steps"])
        if self._optimizer is None:
            self._pending_state = state_dict  # applied once the stage's parameters are known
        else:
            self._load(state_dict)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict["torch"] is not None:
            self._optimizer.load_state_dict(_clone(state_dict["torch"]))
        if self._scheduler is not None and state_dict["scheduler"] is not None:
            self._scheduler.load_state_dict(state_dict["scheduler"])


class SchedulerLR:
    """A ``torch.optim.lr_scheduler`` driving one of pipetrain's own optimizers: the rate of update
    ``n`` is what the scheduler sets after ``n`` steps, replayed on a one-parameter shadow
    optimizer (so it is a pure function of ``n``, and resumes exactly)."""

    def __init__(self, factory: SchedulerFactory, owner: StageOptimizer) -> None:
        self._owner = owner
        shadow = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=owner.lr)
        self._shadow = shadow
        self._scheduler = factory(shadow)
        self._rates = [shadow.param_groups[0]["lr"]]
        self._name = type(self._scheduler).__name__

    def lr_at(self, samples_seen: int, base_lr: float) -> float:
        steps = self._owner.steps
        while len(self._rates) <= steps:
            self._shadow.step()  # no gradient: changes nothing, but keeps the scheduler's order check quiet
            self._scheduler.step()
            self._rates.append(self._shadow.param_groups[0]["lr"])
        return float(self._rates[steps])

    def __repr__(self) -> str:
        return f"SchedulerLR({self._name})"


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value
