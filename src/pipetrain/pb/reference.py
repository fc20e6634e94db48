"""Reference Pipelined Backpropagation, one stage at a time, in two equivalent orders.

Semantics (docs/design.md 3.4/3.5), S stages, samples n = 0, 1, ... in data order, an update every
``u`` samples (default 1):

* the forward of sample n at stage s reads version ``max(0, n - D_s) // u`` of that stage, with
  ``D_s = 2(S-1-s)``; with the ``predict`` policy (Linear Weight Prediction) it reads
  ``optimizer.predict(w_v, samples_seen=v*u)``, computed when version v is made;
* the backward of sample n propagates the error through the weights current at backward time
  (version ``n // u``, policy ``latest`` and ``predict``, see :mod:`pipetrain.pb.latest`) or
  through the forward's weights (``stash``); weight gradients use forward-time activations;
* after every u backwards the stage applies ``w <- optimizer.step(w, grad, samples_seen)`` with
  the mean gradient of the u samples (each sample's loss scaled by 1/u, as in the emulator).

Two orders compute this and must agree bit for bit: :func:`pb_sequential` (for each sample: all
forwards, all backwards, all updates; forward weights come from a ring of versions) and
:func:`pb_ticks` (the pipeline as hardware runs it: in tick t stage s runs the forward of sample
``t - s`` on its current weights, then the backward of sample ``t - (2S-2-s)``; the delays are not
programmed, they emerge). Both are slow (one autograd call per stage and sample); they are the
reference that the batched engine (:mod:`pipetrain.pb.engine`) is tested against, and the
fallback for stage modules it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from pipetrain.errors import ConfigError
from pipetrain.models import refuse_batchnorm
from pipetrain.optim import StageOptimizer
from pipetrain.pb.latest import LatestWeights
from pipetrain.schedule import pb_delays

__all__ = ["ReferenceResult", "pb_sequential", "pb_ticks", "POLICIES"]

#: Weight-version policies of the reference: what the backward (and the forward) reads.
POLICIES = ("latest", "predict", "stash")

Sample = tuple[Any, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class ReferenceResult:
    """Final weights of each stage (name -> tensor) and the loss of every sample in order."""

    params: list[dict[str, Tensor]]
    losses: list[float]
    updates: list[int] = field(default_factory=list)


def _cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(output, target)


@dataclass
class _Record:
    """What a sample leaves on a stage between its forward and its backward."""

    inputs: tuple
    root: Tensor
    leaves: dict[str, Tensor]


class _Stage:
    """One stage: its module's structure, the current weights, forward-weight versions, optimizer."""

    def __init__(self, index: int, module: nn.Module, optimizer: StageOptimizer, policy: str, keep: int):
        self.index = index
        self.module = module
        self.optimizer = optimizer
        self.policy = policy
        self.keep = keep
        named = dict(module.named_parameters())
        self.trainable = [n for n, p in named.items() if p.requires_grad]
        self.buffers = dict(module.named_buffers())
        self.current: dict[str, Tensor] = {n: p.detach().clone() for n, p in named.items()}
        self.version = 0
        self.samples_seen = 0
        self.forward_weights: dict[int, dict[str, Tensor]] = {0: self._forward_weights()}
        self.grads: dict[str, Tensor] = {}
        self.pending = 0

    def _forward_weights(self) -> dict[str, Tensor]:
        if self.policy == "predict":
            return self.optimizer.predict(self.current, self.samples_seen)
        return self.current

    def forward(self, version: int, inputs: Any, target: Tensor | None, loss_fn: LossFn | None, scale: float):
        params = self.forward_weights[version]
        leaves = {n: t.detach().requires_grad_(n in self.trainable) for n, t in params.items()}
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        if self.index > 0:
            args = tuple(
                a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point() else a
                for a in args
            )
        hooks = LatestWeights(leaves, lambda: self.current) if self.policy != "stash" else None
        if hooks is not None:
            with hooks:
                output, loss = self._run(leaves, args, target, loss_fn)
        else:
            output, loss = self._run(leaves, args, target, loss_fn)
        if loss is not None:
            root = loss * scale if scale != 1.0 else loss
            record = _Record(args, root, {n: leaves[n] for n in self.trainable})
            return loss.detach(), record
        outputs = output if isinstance(output, tuple) else (output,)
        if len(outputs) != 1:
            raise ConfigError(
                f"stage {self.index} returns {len(outputs)} tensors; the PB reference passes one "
                f"tensor between stages"
            )
        record = _Record(args, outputs[0], {n: leaves[n] for n in self.trainable})
        return outputs[0].detach(), record

    def _run(self, leaves, args, target, loss_fn):
        output = functional_call(self.module, {**leaves, **self.buffers}, args)
        loss = loss_fn(output, target) if loss_fn is not None else None
        return output, loss

    def backward(self, record: _Record, grad_output: Tensor | None) -> Tensor | None:
        """Backward of one sample; accumulates weight gradients, returns the input gradient."""
        wants_input = [a for a in record.inputs if isinstance(a, Tensor) and a.requires_grad]
        names = list(record.leaves)
        targets = wants_input[:1] + [record.leaves[n] for n in names]
        if not targets:
            return None
        grads = torch.autograd.grad(
            record.root, targets, None if grad_output is None else grad_output, allow_unused=True
        )
        weight_grads = grads[len(wants_input[:1]) :]
        for name, grad in zip(names, weight_grads):
            if grad is None:
                continue
            if name in self.grads:
                self.grads[name].add_(grad)
            else:
                self.grads[name] = grad
        self.pending += 1
        return grads[0] if wants_input else None

    def update(self) -> None:
        self.current = self.optimizer.step(self.current, self.grads, self.samples_seen)
        self.samples_seen += self.pending
        self.pending = 0
        self.grads = {}
        self.version += 1
        self.forward_weights[self.version] = self._forward_weights()
        for old in [v for v in self.forward_weights if v <= self.version - self.keep]:
            del self.forward_weights[old]


def _setup(stages, optimizers, samples, policy, delays, update_every, form):
    stages = list(stages)
    if not stages:
        raise ConfigError("Pipelined Backpropagation needs at least one stage")
    if len(optimizers) != len(stages):
        raise ConfigError(f"{len(optimizers)} optimizers for {len(stages)} stages; give one per stage")
    for stage in stages:
        refuse_batchnorm(stage)
    if policy is None:
        policy = "predict" if any(getattr(o, "lwp_horizon", 0.0) > 0 for o in optimizers) else "latest"
    if policy not in POLICIES:
        raise ConfigError(f"unknown PB weight policy {policy!r}; choose one of {', '.join(POLICIES)}")
    standard = pb_delays(len(stages))
    delays = standard if delays is None else [int(d) for d in delays]
    if len(delays) != len(stages) or any(d < 0 for d in delays):
        raise ConfigError(f"delays {delays} must be {len(stages)} integers >= 0, one per stage")
    if form == "ticks" and delays != standard:
        raise ConfigError(
            f"the tick-by-tick pipeline has the delays {standard} by construction; other delays "
            f"exist only in the sample-sequential form"
        )
    if not isinstance(update_every, int) or update_every < 1:
        raise ConfigError(f"update_every={update_every!r} must be a positive integer")
    keep = max(delays) // update_every + 2
    states = [_Stage(s, m, o, policy, keep) for s, (m, o) in enumerate(zip(stages, optimizers))]
    return states, list(samples), delays


def _finish_update(stage: _Stage, n: int, total: int, update_every: int, updates: list[int]) -> None:
    if (n + 1) % update_every == 0 or n == total - 1:
        stage.update()
        updates[stage.index] += 1


def pb_sequential(
    stages: Sequence[nn.Module],
    optimizers: Sequence[StageOptimizer],
    samples: Sequence[Sample],
    *,
    policy: str | None = None,
    delays: Sequence[int] | None = None,
    update_every: int = 1,
    loss_fn: LossFn = _cross_entropy,
) -> ReferenceResult:
    """PB as one sample after the other: forwards on delayed versions, backwards, updates.

    ``samples`` are ``(x, y)`` pairs with a leading batch dimension (one sample: ``x[None]``).
    ``policy`` defaults to ``predict`` when an optimizer has an LWP horizon, else ``latest``.
    ``delays`` replaces ``D_s`` (all zeros: batch-size-``u`` momentum SGD, bitwise). The stage
    modules are not modified; the result holds the final weights.
    """
    states, samples, delays = _setup(stages, optimizers, samples, policy, delays, update_every, "sequential")
    total = len(samples)
    scale = 1.0 / update_every
    losses: list[float] = []
    updates = [0] * len(states)
    last = len(states) - 1
    for n, (x, y) in enumerate(samples):
        records = []
        h: Any = x
        for stage in states:
            version = max(0, n - delays[stage.index]) // update_every
            is_last = stage.index == last
            h, record = stage.forward(version, h, y if is_last else None, loss_fn if is_last else None, scale)
            records.append(record)
        losses.append(float(h))
        grad = None
        for stage in reversed(states):
            grad = stage.backward(records[stage.index], grad)
        for stage in states:
            _finish_update(stage, n, total, update_every, updates)
    return ReferenceResult([dict(s.current) for s in states], losses, updates)


def pb_ticks(
    stages: Sequence[nn.Module],
    optimizers: Sequence[StageOptimizer],
    samples: Sequence[Sample],
    *,
    policy: str | None = None,
    update_every: int = 1,
    loss_fn: LossFn = _cross_entropy,
) -> ReferenceResult:
    """PB as the pipeline runs it, tick by tick; every forward reads the stage's current weights.

    Tick t (S = 3)::

        stage 0:  F(t)                 B(t-4)
        stage 1:  F(t-1)               B(t-3)
        stage 2:  F(t-2) loss B(t-2)

    A forward's output reaches the next stage in the next tick, an input gradient the previous
    stage in the next tick. Same arguments and result as :func:`pb_sequential` (bitwise).
    """
    states, samples, _ = _setup(stages, optimizers, samples, policy, None, update_every, "ticks")
    total = len(samples)
    count = len(states)
    last = count - 1
    scale = 1.0 / update_every
    losses: list[float] = [float("nan")] * total
    updates = [0] * count
    records: list[dict[int, _Record]] = [{} for _ in states]
    forward_inbox: list[Any] = [None] * count
    backward_inbox: list[Tensor | None] = [None] * count
    for tick in range(total + 2 * count - 2):
        forward_outbox: list[Any] = [None] * count
        backward_outbox: list[Tensor | None] = [None] * count
        for stage in states:
            n = tick - stage.index
            if not 0 <= n < total:
                continue
            is_last = stage.index == last
            x = samples[n][0] if stage.index == 0 else forward_inbox[stage.index]
            out, records[stage.index][n] = stage.forward(
                stage.version, x, samples[n][1] if is_last else None, loss_fn if is_last else None, scale
            )
            if is_last:
                losses[n] = float(out)
            else:
                forward_outbox[stage.index + 1] = out
        for stage in reversed(states):
            n = tick - (2 * count - 2 - stage.index)
            if not 0 <= n < total:
                continue
            grad = None if stage.index == last else backward_inbox[stage.index]
            grad_in = stage.backward(records[stage.index].pop(n), grad)
            if stage.index > 0:
                backward_outbox[stage.index - 1] = grad_in
            _finish_update(stage, n, total, update_every, updates)
        forward_inbox, backward_inbox = forward_outbox, backward_outbox
    return ReferenceResult([dict(s.current) for s in states], losses, updates)
