"""The functional per-stage optimizer interface shared by the emulator and the runtime."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.optim import fused
from pipetrain.optim.lr_schedule import ConstantLR, LRSchedule

__all__ = ["StageOptimizer", "Params", "Grads"]

Params = Mapping[str, Tensor]
Grads = Mapping[str, "Tensor | None"]


class StageOptimizer(ABC):
    """Turns one stage's weights and gradients into *new* weights, never touching the old ones.

    Why functional: a pipeline stage keeps several weight versions alive at once (stashed versions
    for backwards still in flight, the predicted weights of Linear Weight Prediction, the version
    a replica is about to send), and autograd may have saved any of those tensors for a backward
    that has not run yet. An in-place ``param.add_()`` would corrupt those versions (PyTorch
    raises "modified by an inplace operation", or worse, silently computes with the new values:
    the original PipeDream broke on PyTorch >= 1.5 exactly this way). So :meth:`step` returns new
    tensors and the caller decides which version to keep. The optimizer's own state (momentum
    buffers, Adam moments) is never seen by autograd and is updated in place.

    Every update uses the learning rate ``lr_at(samples_seen)`` of the schedule, and each subclass
    repeats the arithmetic of the corresponding ``torch.optim`` class (single-tensor path) op for
    op, so results are bitwise reproducible across processes and equal to PyTorch's.

    Returned tensors are plain leaf tensors with ``requires_grad`` copied from the input
    parameter; a parameter whose gradient is ``None`` (or absent) is returned as the same object.
    The one exception is the caller's to make: ``step(..., out=tensors)`` writes the new values
    into given tensors, those of a version no reader needs any more (the stage executor passes the
    replaced version's own tensors when the update releases it, else those of an older released
    version, see :class:`~pipetrain.execution.VersionStore`), which saves an allocation per
    parameter and per update; the arithmetic, and so every bit of the result, is the same.
    """

    #: Short name used in specs and state dicts (``"sgd"``, ``"adam"``, ``"adamw"``).
    name: ClassVar[str]

    def __init__(
        self, lr: float, *, lr_schedule: LRSchedule | None = None, lwp_horizon: float = 0.0
    ) -> None:
        if not lr >= 0.0:
            raise ConfigError(f"learning rate lr={lr} must be >= 0")
        if not lwp_horizon >= 0.0:
            raise ConfigError(f"lwp_horizon={lwp_horizon} must be >= 0 (0 disables prediction)")
        self.lr = float(lr)
        self.lr_schedule: LRSchedule = lr_schedule if lr_schedule is not None else ConstantLR()
        self.lwp_horizon = float(lwp_horizon)
        #: Number of :meth:`step` calls so far.
        self.steps = 0
        #: Per-parameter state: name -> {"buffer name": tensor or int}.
        self.state: dict[str, dict[str, Any]] = {}

    @property
    @abstractmethod
    def state_slots(self) -> int:
        """Parameter-sized state tensors kept per parameter (for memory models)."""

    # -- learning rate ---------------------------------------------------------------------------

    def lr_at(self, samples_seen: int) -> float:
        """The learning rate in force after ``samples_seen`` training samples."""
        return self.lr_schedule.lr_at(samples_seen, self.lr)

    # -- update ----------------------------------------------------------------------------------

    def step(
        self, params: Params, grads: Grads, samples_seen: int, *, out: Params | None = None
    ) -> dict[str, Tensor]:
        """Apply one update; returns new parameter tensors (``params`` and ``grads`` are unchanged).

        ``samples_seen`` counts the samples applied by earlier updates and selects the learning
        rate. Parameters whose gradient is ``None`` or missing keep their tensor and their state.
        ``out`` gives tensors to write the new values into, by name (``out=params``: in place, for
        a version nothing reads any more; a buffer of a released version; a name missing from
        ``out`` gets a new tensor). Results are bitwise the same whichever way they are written.
        """
        if not grads.keys() <= params.keys():
            unknown = [name for name in grads if name not in params]
            raise PipetrainError(
                f"gradients for unknown parameters {unknown}; the stage's parameters are "
                f"{list(params)}"
            )
        lr = self.lr_at(samples_seen)
        names = [name for name, grad in grads.items() if grad is not None]
        if list(params) != names:  # in the parameters' order (the order of every state and result)
            names = [name for name in params if grads.get(name) is not None]
        bases = [params[name] for name in names]
        gradients = [grads[name] for name in names]
        for name, param, grad in zip(names, bases, gradients):
            if grad.shape != param.shape:
                raise PipetrainError(
                    f"gradient of {name!r} has shape {tuple(grad.shape)} but the parameter "
                    f"has shape {tuple(param.shape)}"
                )
        targets = [None] * len(names) if out is None else [out.get(name) for name in names]
        updated = dict(params)
        with torch.no_grad():
            if names and self._batched and fused.available(bases) and fused.available(gradients):
                results = self._update_all(names, bases, gradients, lr, targets)
            else:
                results = [
                    self._update(name, param.detach(), grad.detach(), lr, target)
                    for name, param, grad, target in zip(names, bases, gradients, targets)
                ]
        for name, param, new in zip(names, bases, results):
            if new.requires_grad != param.requires_grad:
                new.requires_grad_(param.requires_grad)
            updated[name] = new
        self.steps += 1
        return updated

    @property
    def _batched(self) -> bool:
        """Whether this class batches its updates (overrides :meth:`_update_all`)."""
        return type(self)._update_all is not StageOptimizer._update_all

    @abstractmethod
    def _update(self, name: str, param: Tensor, grad: Tensor, lr: float, out: Tensor | None = None) -> Tensor:
        """One parameter's update; must return a new tensor (``out``, when given, which may be
        ``param`` itself: the last operation writes there) and may change ``self.state[name]``.
        This is the single-tensor path, op for op torch's."""

    def _update_all(self, names: list[str], params: list[Tensor], grads: list[Tensor], lr: float,
                    outs: list[Tensor | None]) -> list[Tensor]:
        """Every parameter's update at once, with the arithmetic of :meth:`_update` batched into
        foreach calls (:mod:`pipetrain.optim.fused`); called under ``no_grad`` for CPU tensors only.
        A subclass that overrides it must round exactly as its :meth:`_update`."""
        raise NotImplementedError

    # -- Linear Weight Prediction ----------------------------------------------------------------

    @abstractmethod
    def velocity(self, name: str) -> Tensor | None:
        """The direction of the latest update per unit learning rate (``None`` before any update).

        Linear Weight Prediction extrapolates along it: for momentum SGD it is the momentum buffer
        ``v`` (each update moves the weights by about ``-lr * v``). The tensor may be the live
        buffer that the next :meth:`step` updates in place: clone it to keep it.
        """

    def predict(
        self, params: Params, samples_seen: int, horizon: float | None = None, *, out: Params | None = None
    ) -> dict[str, Tensor]:
        """Linear Weight Prediction: ``w_hat = w - lr * T * velocity`` for the forward pass.

        ``T = horizon`` (default: this stage's ``lwp_horizon``) and ``lr = lr_at(samples_seen)``,
        the rate in force when the forward runs. ``T = 0`` returns the same tensors. Backward,
        update, evaluation and checkpoints use the true weights ``w``, never ``w_hat``. ``out``
        gives tensors to write predictions into, by name (those of an earlier prediction nothing
        reads any more); a parameter without a velocity is returned as itself.
        """
        horizon = self.lwp_horizon if horizon is None else float(horizon)
        if not horizon >= 0.0:
            raise ConfigError(f"prediction horizon {horizon} must be >= 0")
        if horizon == 0.0:
            return dict(params)
        self._check_can_predict()
        step = self.lr_at(samples_seen) * horizon
        predicted: dict[str, Tensor] = dict(params)
        with torch.no_grad():
            if type(self)._predict_one is StageOptimizer._predict_one:  # w - lr*T*v: batched
                names, bases, velocities, targets = [], [], [], []
                for name, param in params.items():
                    velocity = self.velocity(name)
                    if velocity is not None:
                        names.append(name)
                        bases.append(param)
                        velocities.append(velocity)
                        targets.append(None if out is None else out.get(name))
                if fused.available(bases + velocities):
                    results = fused.add_into(targets, bases, velocities, -step)
                else:
                    results = [torch.add(b, v, alpha=-step, out=t) for b, v, t in zip(bases, velocities, targets)]
                made = zip(names, results)
            else:
                made = ((name, self._predict_one(name, param.detach(), step, None if out is None else out.get(name)))
                        for name, param in params.items())
            for name, new in made:
                if new is None:
                    continue
                param = params[name]
                if new.requires_grad != param.requires_grad:
                    new.requires_grad_(param.requires_grad)
                predicted[name] = new
        return predicted

    def _predict_one(self, name: str, param: Tensor, lr_horizon: float, out: Tensor | None = None) -> Tensor | None:
        """One parameter's prediction (into ``out`` when given), or None without a velocity; a
        subclass whose prediction is not ``w - lr*T*velocity`` overrides it."""
        velocity = self.velocity(name)
        return None if velocity is None else torch.add(param, velocity, alpha=-lr_horizon, out=out)

    def _check_can_predict(self) -> None:  # noqa: B027 - a hook: most optimizers can predict
        """Raise if this optimizer keeps no velocity to predict with."""

    # -- description and checkpoints -------------------------------------------------------------

    @abstractmethod
    def hyperparameters(self) -> dict[str, Any]:
        """The settings of this optimizer as plain values (also written into state dicts)."""

    def state_bytes(self) -> int:
        """Bytes held by the optimizer's state tensors right now."""
        return sum(
            value.numel() * value.element_size()
            for slots in self.state.values()
            for value in slots.values()
            if isinstance(value, Tensor)
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step count and all buffers (cloned)."""
        return {
            "optimizer": self.name,
            "steps": self.steps,
            "hyperparameters": self.hyperparameters(),
            "state": {
                name: {key: _copy(value) for key, value in slots.items()}
                for name, slots in self.state.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; hyper-parameters stay those of this object."""
        kind = state_dict.get("optimizer") if isinstance(state_dict, Mapping) else None
        if kind != self.name:
            raise ConfigError(
                f"cannot load a {kind!r} optimizer state into a {self.name!r} optimizer; resume "
                f"with the optimizer the checkpoint was written with"
            )
        self.steps = int(state_dict["steps"])
        self.state = {
            name: {key: _copy(value) for key, value in slots.items()}
            for name, slots in state_dict["state"].items()
        }

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({settings})"


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value
