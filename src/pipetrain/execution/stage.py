"""One stage replica at work: forward and backward of microbatches on the weight version an action
names, gradient accumulation, and updates that make new versions.

Each concern is a piece of its own that the executor composes: versions and inconsistent backward
(``latest``, ``predict``) in :mod:`~pipetrain.execution.parameters` and
:mod:`~pipetrain.execution.leaves`, the microbatches in flight in :mod:`~pipetrain.execution.inflight`,
the gradient sums in :mod:`~pipetrain.execution.accumulation`, the update in
:mod:`~pipetrain.execution.update`, non-finite values in :mod:`~pipetrain.execution.nonfinite`,
recomputation in :mod:`~pipetrain.execution.recompute`, mixed precision in
:mod:`~pipetrain.execution.device`, float16's loss scale in :mod:`~pipetrain.execution.scaling`,
checkpoints in :mod:`~pipetrain.execution.snapshot`, held-out data in :mod:`~pipetrain.execution.evaluation`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipetrain.execution.accumulation import GradientSums
from pipetrain.execution.device import autocast_on, to_device
from pipetrain.execution.evaluation import evaluate_stage
from pipetrain.execution.failures import PLAIN, StageNames, computed_loss, forward_errors
from pipetrain.execution.parameters import INCONSISTENT as _INCONSISTENT
from pipetrain.execution.parameters import Parameters, SavedParameters
from pipetrain.execution.inflight import Gradients, InFlight, InFlightTable, constants_of, forward_inputs
from pipetrain.execution.leaves import ForwardLeaves
from pipetrain.execution.nonfinite import NonFiniteGuard
from pipetrain.execution.recompute import Recomputation, is_stochastic, microbatch_seed
from pipetrain.execution.scaling import LossScale, StageScale
from pipetrain.execution.snapshot import restore_stage, stage_snapshot
from pipetrain.execution.split_backward import input_half
from pipetrain.execution.update import apply_update
from pipetrain.execution.update_in_backward import fused_update, update_wanted
from pipetrain.execution.version_store import VersionStore
from pipetrain.structure import flatten

__all__ = ["StageExecutor"]


@functools.lru_cache(maxsize=None)
def warm_up_autograd() -> None:
    """The first ``torch.autograd.grad`` with explicit output gradients imports sympy (about a
    second); pay that once when a stage is built, not inside the first timed backward."""
    x = torch.zeros(1, requires_grad=True)
    torch.autograd.grad(x * 2, (x,), (torch.ones(1),))


class StageExecutor:
    """A stage replica: module, weight versions, optimizer, accumulated gradients, in-flight work.

    Args:
        stage: the stage index (for messages and random seeds).
        module: the stage's module; its parameters become version 0.
        optimizer: a functional :class:`~pipetrain.optim.StageOptimizer` (``None``: no updates).
        loss_fn: on the last stage, ``loss_fn(output, target)`` (a mean over the samples).
        policy: the schedule's version policy; ``latest``/``predict`` turn on inconsistent backward,
            ``predict`` makes forwards read ``optimizer.predict`` of their version.
        grad_scale: factor applied to the accumulated gradient at each update (1 unless replicated
            stages update over different numbers of units, see :mod:`pipetrain.execution.data`).
        seed: base of the per-microbatch random seed used when the stage has dropout.
        nonfinite: ``stop``, ``skip`` or ``off`` (see :mod:`pipetrain.execution.nonfinite`).
        recompute: keep only the inputs of each microbatch and run its forward again in the
            backward (:mod:`pipetrain.execution.recompute`): activation memory for time.
        autocast: ``torch.bfloat16`` to run forwards under ``torch.autocast``, with master weights in
            the module's dtype; ``None``: no autocast.
        device: where the stage computes (default: where its parameters or buffers are, else the
            CPU; give it for a stage without either, such as an activation function alone).
        scaler: float16's loss scale (:mod:`pipetrain.execution.scaling`; ``None``: no loss scale, no
            stamp and no flag in the messages). Every stage of a run gets one or none.
        units_per_update: microbatches per update (stage 0 stamps one scale per update).
        own_weights: names of parameters that are this executor's alone (materialised for it from
            a model built on the meta device, :mod:`pipetrain.stages.materialize`): version 0 is
            their tensors, not a copy, so a stage holds its weights once. Others are copied, so
            that training leaves the caller's module as it is until :meth:`write_back`.
        update_in_backward: apply each one-microbatch update during its backward, parameter by
            parameter, so that the stage never holds its whole gradient (only where the caller
            knows nothing else needs it: :mod:`pipetrain.execution.update_in_backward`).
        names: how messages name the stage (:class:`~pipetrain.execution.failures.StageNames`:
            with model chunks, ``stage`` is a piece of a stage the user asked for).
    """

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        optimizer: Any,
        *,
        loss_fn: Callable[[Any, Tensor], Tensor] | None = None,
        policy: str = "flush",
        grad_scale: float = 1.0,
        seed: int = 0,
        nonfinite: str = "stop",
        recompute: bool = False,
        autocast: torch.dtype | None = None,
        device: torch.device | None = None,
        scaler: LossScale | None = None,
        units_per_update: int = 1,
        own_weights: frozenset[str] = frozenset(),
        update_in_backward: bool = False,
        names: StageNames = PLAIN,
    ) -> None:
        self.names = names
        self.guard = NonFiniteGuard(stage, nonfinite, names)
        self.nonfinite = nonfinite
        self.stage = stage
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.policy = policy
        self.grad_scale = grad_scale
        self.seed = seed
        self.recompute = recompute
        self.autocast = autocast
        self.scaler = scaler
        self.units_per_update = units_per_update
        named = dict(module.named_parameters())
        self.trainable = frozenset(n for n, p in named.items() if p.requires_grad)
        # recomputing microbatches may still read a released version (PB's latest): its buffers are not reused
        self.versions = VersionStore({n: p.detach() if n in own_weights else p.detach().clone() for n, p in named.items()},
                                     recycle=not recompute)
        self.buffers = dict(module.named_buffers())
        self.call = Parameters(module)
        self.stochastic = is_stochastic(module)
        #: where the stage computes, and what arrives is moved to (see the ``device`` argument)
        self.device = torch.device(device) if device is not None else next(
            (t.device for t in [*self.versions.latest.values(), *self.buffers.values()]), torch.device("cpu"))
        #: float16: this stage's part in the loss scale (``None`` without one)
        self.scaling = None if scaler is None else StageScale(stage, scaler, units_per_update, self.device)
        seeds = functools.partial(microbatch_seed, seed, stage) if self.stochastic else None
        self.recomputation = Recomputation(module, self.device, seeds, recompute)
        self.in_flight = InFlightTable(stage)
        self.sums = GradientSums()  # see the grads property
        self.pending_samples = 0
        self.samples_seen = 0
        self.last_loss: Tensor | None = None
        #: the floating outputs of the last forward that need no gradient (bit i: leaf i; they did not
        #: require grad here, e.g. a mask built from a shape or a passed-on model input): the next
        #: stage's ``forward(constants=...)``, so that it neither computes nor sends gradients for them
        self.last_constants = 0
        self.saved = SavedParameters()
        self.leaves = ForwardLeaves(self.trainable)
        self.fused = fused_update(optimizer, update_wanted(update_in_backward, units_per_update, scaler, nonfinite))
        warm_up_autograd()

    @property
    def scales(self) -> list[float]:
        """float16: the scale of each update so far."""
        return [] if self.scaling is None else self.scaling.scales

    @property
    def overflow_skipped(self) -> list[int]:
        """float16: the updates (from 1) skipped because their gradient overflowed."""
        return [] if self.scaling is None else self.scaling.overflow_skipped

    @property
    def skipped(self) -> list[int]:
        """The updates (counted from 1) skipped because their gradient was not finite (``skip``)."""
        return self.guard.skipped

    @property
    def grads(self) -> dict[str, Tensor] | None:
        """The weight gradients accumulated since the last update (``None`` before a backward; see
        :mod:`pipetrain.execution.accumulation`: reading this property takes them off the leaves)."""
        return self.sums.take()

    @grads.setter
    def grads(self, value: dict[str, Tensor] | None) -> None:
        self.sums.replace(value)

    @property
    def is_last(self) -> bool:
        return self.loss_fn is not None

    # -- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        microbatch: int,
        version: int,
        inputs: Any,
        *,
        target: Tensor | None = None,
        loss_scale: float = 1.0,
        samples: int = 0,
        params: Mapping[str, Tensor] | None = None,
        stamp: float | None = None,
        constants: int = 0,
    ) -> Any:
        """Run the forward of ``microbatch`` on ``version``; returns the outputs to pass on (detached),
        or on the last stage ``(loss,)`` with the unscaled mean loss.

        ``inputs`` is what the previous stage returned (or the model input): a tensor, a tuple of
        tensors, or any structure of them (:mod:`pipetrain.structure`), called under the boundary
        convention. The outputs come back as a tuple of tensors (a tensor ``t`` as ``(t,)``), or as
        the structure the stage returned; the backward's ``grad_outputs`` follow the outputs'
        leaves, and the gradients it returns the inputs' leaves. ``constants`` (the previous
        stage's :attr:`last_constants`) marks floating inputs that take no gradient
        (:func:`~pipetrain.execution.inflight.forward_inputs`).

        ``params`` replaces the weights read (e.g. predictions made earlier); by default the
        forward reads ``version``, extrapolated by the optimizer under the ``predict`` policy.
        """
        self.in_flight.check_new(microbatch)
        leaves, predicted = self.leaves.read(self.versions, version, params, self.policy == "predict", self.optimizer,
                                             self.samples_seen)
        device = self.device  # a batch read on the CPU, or a message, comes to the stage's device
        scale = 1.0
        if self.scaling is not None:
            inputs, scale = self.scaling.received(microbatch, inputs, stamp)
        inputs, structure = forward_inputs(inputs, device, self.stage > 0, constants)
        if target is not None:  # a tensor, or the user's structure of them, on the stage's device
            target = to_device(target, device, non_blocking=True)
        rng = self.recomputation.begin(microbatch)  # seeds a stage with dropout
        record = InFlight(inputs, (), {n: leaves[n] for n in self.trainable}, samples, version, target, loss_scale,
                           scale=scale, leaf_set=leaves, microbatch=microbatch, predicted=predicted,
                           structure=structure, rng=rng)
        with forward_errors(self.stage, inputs, self.module, structure=structure, target=target, microbatch=microbatch,
                            names=self.names):
            with torch.no_grad() if self.recompute else contextlib.nullcontext():
                output, loss = self._compute(record)
        if self.is_last:
            self.last_loss = loss.detach()
            self.guard.check_loss(microbatch, self.last_loss, inputs, self.versions.latest)
            outputs, shape = (), None
        else:
            outputs, shape = flatten(output)
            self.last_constants = constants_of(outputs, inputs, self.recompute)
        if not self.recompute:  # else its backward runs the forward again first
            record.roots = (record.scaled(loss),) if self.is_last else outputs
        self.in_flight[microbatch] = record
        if self.is_last:
            return (self.last_loss,)
        sent: Any = tuple(o.detach() if isinstance(o, Tensor) else o for o in outputs)
        if shape is not None:
            sent = shape.unflatten(sent)
        return sent if self.scaling is None else self.scaling.sent(sent, scale)

    def _compute(self, record: InFlight) -> tuple[Any, Tensor | None]:
        """The stage's forward (and on the last stage the loss) of ``record`` on its leaves; when
        recording a graph under ``latest``/``predict``, with the hooks that let the backward read
        its own version."""
        hooks = contextlib.nullcontext()
        if self.policy in _INCONSISTENT and torch.is_grad_enabled():
            record.storage = {t.untyped_storage().data_ptr(): n for n, t in record.leaf_set.items()}
            hooks = self.saved.recording(record.storage)
        with autocast_on(self.device, self.autocast), hooks:
            output = self.call(record.leaf_set, record.inputs, record.structure)
            loss = computed_loss(self.stage, self.loss_fn, output, record.target, self.names) if self.is_last else None
        return output, loss

    def _recomputed(self, record: InFlight) -> InFlight:
        """``record``, its forward run again (:class:`~pipetrain.execution.recompute.Recomputation`)
        if it must, recording the graph its backward needs (without recomputation or once done: as it is)."""
        if not record.roots and self.recompute:
            output, loss = self.recomputation.again(record.microbatch, record.rng, lambda: self._compute(record))
            record.roots = (record.scaled(loss),) if self.is_last else flatten(output)[0]
        return record

    # -- backward --------------------------------------------------------------------------------

    def _input_gradients(self, record: InFlight, version: int, inputs: list[Tensor], grad_outputs):
        """The I half of a split backward: gradients of ``inputs``, keeping for W what it needs
        (:mod:`pipetrain.execution.split_backward`: the gradients entering the weights' part of the
        graph, the roots dropped; where it cannot, the whole graph)."""
        roots, grads = self._recomputed(record).differentiable(grad_outputs)
        if not roots or not inputs:
            return [None] * len(inputs)
        with self.saved.resolving(self.versions[version] if self.policy in _INCONSISTENT else None):
            results, record.weight_half = input_half(roots, grads, inputs, list(record.leaves.values()))
        if record.weight_half is not None:  # the graph above the weights' part goes now, and what arrived
            record.roots, record.grad_outputs = record.weight_half.owner, None
        return results

    def backward(self, microbatch: int, version: int, grad_outputs: Sequence | None = None) -> Gradients:
        """Full backward: returns gradients for the stage inputs (None where an input has none) and
        accumulates the weight gradients."""
        record = self.in_flight.take(microbatch)
        grad_outputs, flagged = self._arrived(record, grad_outputs)
        positions = record.input_positions()
        results = self._backward_into(record, version, [record.inputs[i] for i in positions], grad_outputs)
        self.leaves.free(record.predicted)
        grads = record.input_gradients(positions, results)
        return grads if self.scaling is None else self.scaling.sent_back(record.leaves.values(), flagged, grads)

    def _arrived(self, record: InFlight, grad_outputs: Sequence | None) -> tuple[Any, bool]:
        """The gradients that arrived for ``record`` on this device and, under float16, the
        overflow flag after them (taken off); the update's scale must be the record's."""
        if grad_outputs is not None:
            grad_outputs = to_device(tuple(grad_outputs), self.device, non_blocking=True)
        if self.scaling is None:
            return grad_outputs, False
        return self.scaling.arrived(record.microbatch, record.scale, grad_outputs)

    @property
    def overflowed(self) -> bool:
        """float16: whether the update being accumulated has overflowed so far (here or flagged later)."""
        return self.scaling is not None and self.scaling.overflow

    def share_overflow(self, overflow: bool) -> None:
        """SYNC under float16: whether any replica's part of the update overflowed (:meth:`StageScale.share`)."""
        if self.scaling is not None:
            self.scaling.share(overflow)

    def backward_input(self, microbatch: int, version: int, grad_outputs: Sequence | None = None) -> Gradients:
        """Input-gradient half of a split backward (I); the weight half (W) runs later."""
        record = self.in_flight.record(microbatch)
        grad_outputs, flagged = self._arrived(record, grad_outputs)
        record.grad_outputs = grad_outputs
        positions = record.input_positions()
        inputs = [record.inputs[i] for i in positions]
        results = self._input_gradients(record, version, inputs, grad_outputs) if positions else []
        grads = record.input_gradients(positions, results)
        if self.scaling is not None:
            grads = self.scaling.sent_back_by_input_half(record.leaves.values(), flagged, grads)
        return grads

    def backward_weight(self, microbatch: int, version: int) -> None:
        """Weight-gradient half of a split backward (W)."""
        record = self.in_flight.take(microbatch)
        self._backward_into(record, version, [], record.grad_outputs, weights_only=True)
        self.leaves.free(record.predicted)
        if self.scaling is not None:
            self.scaling.tested_by_weight_half(record.leaves.values())

    def _backward_into(
        self, record: InFlight, version: int, inputs: list[Tensor], grad_outputs, weights_only: bool = False
    ) -> list:
        """Backward of ``record`` that adds its weight gradients to the accumulated ones inside
        autograd (:mod:`pipetrain.execution.accumulation`), and returns the gradients of ``inputs``."""
        self.pending_samples += record.samples
        self.sums.open()
        if weights_only and record.weight_half is not None:  # W from what I kept
            self.sums.hold(record.leaf_set, record.leaves)
            with self.saved.resolving(self.versions[version] if self.policy in _INCONSISTENT else None):
                record.weight_half.run()
            record.weight_half = None
            return []
        roots, grads = self._recomputed(record).differentiable(grad_outputs)
        if not roots or not (inputs or record.leaves):
            return [None] * len(inputs)
        self.sums.hold(record.leaf_set, record.leaves)
        for x in inputs:
            x.grad = None
        hooks = []
        if (self.fused is not None and not weights_only and self.pending_samples == record.samples  # the first
                and self.grad_scale == 1.0 and all(leaf.grad is None for leaf in record.leaves.values())
                and self.fused.applies(self.versions, version, bool(self.in_flight), list(record.leaves))):
            hooks = self.fused.hook(record.leaves, self.versions[version], self.samples_seen)
        try:
            with self.saved.resolving(self.versions[version] if self.policy in _INCONSISTENT else None):
                if weights_only:  # W of a split backward: the input gradients are done, skip them
                    torch.autograd.backward(roots, grads, inputs=list(record.leaves.values()))
                else:  # every leaf of the graph is an input or a weight (naming them costs a graph walk)
                    torch.autograd.backward(roots, grads)
        finally:
            for handle in hooks:
                handle.remove()
        return [x.grad for x in inputs]

    # -- update ----------------------------------------------------------------------------------

    def step(self, release: Sequence[int] = ()) -> int:
        """Apply the accumulated gradient: a new weight version. Returns its number.

        ``release`` lists versions no longer needed once this update is made. They are dropped
        before the update, so that it writes into their tensors (a stage never holds more versions
        than its schedule says, and in steady state allocates none): into the current version's
        own tensors when it is among them (in place), else into those of released versions
        (:meth:`VersionStore.spares`).
        """
        return apply_update(self, release)

    def release(self, version: int) -> None:
        """Drop ``version`` once no action reads it, with the autograd leaves cached for it (the
        current version stays until the next update)."""
        self.versions.release(version)
        self.leaves.forget(self.versions, version)

    # -- checkpoints -----------------------------------------------------------------------------

    def check_weights(self, consequence: str) -> None:
        """Raise a :class:`~pipetrain.errors.NonFiniteError` if a weight version this stage holds is
        not finite (:meth:`NonFiniteGuard.check_weights`)."""
        self.guard.check_weights(self.versions, consequence)

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to continue exactly (:mod:`pipetrain.execution.snapshot`); weights that
        are not finite are refused: no checkpoint holds them."""
        return stage_snapshot(self)

    def restore(self, state: dict[str, Any]) -> list[tuple[int, Any, int]]:
        """Load a :meth:`snapshot` and replay the forwards that were in flight; returns
        ``[(microbatch, outputs, constants)]`` in their original order (for the messages that
        crossed; ``constants`` as :attr:`last_constants`). The state's tensors come to this stage's
        device, wherever they were saved."""
        return restore_stage(self, state)

    # -- results ---------------------------------------------------------------------------------

    def evaluate(self, inputs: Any) -> Any:
        """Forward-only pass on the current weights (module in eval mode), for held-out data."""
        return evaluate_stage(self.stage, self.call, self.versions.latest, inputs, self.device, self.autocast,
                              self.names)

    def write_back(self) -> None:
        """Copy the current version into the module's own parameters (for saving or inspection);
        weights that are not finite are refused (unless ``nonfinite="off"``)."""
        self.check_weights("they were not written back")
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                param.copy_(self.versions.latest[name])
