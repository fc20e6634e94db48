"""The batched PB engine: the tick-by-tick pipeline with all stages (and runs) computed together.

In tick t of Pipelined Backpropagation stage s runs the forward of sample ``t - s`` and the
backward of sample ``t - (2S-2-s)``, independently of the other stages. So the engine computes,
in each tick, the same unit of every stage of every run as one stacked operation (see
:mod:`pipetrain.pb.kernels`): a *member* is one (run, stage) pair, and the units at position j
inside their stages that have the same structure form a *group* whose weights are stacked
``[G, P]`` (one flat row per member; built by :mod:`pipetrain.pb.groups`). Python overhead is then paid per group, not per stage:
a 32-stage residual MLP runs three groups per tick (input layer, 30 blocks, head).

Per tick (forward, then backward, then update, as in :func:`pipetrain.pb.pb_ticks`)::

    forward   positions j = 0, 1, ...: each group gathers its inputs (the data, the previous
              stage's output of the previous tick, or its own stage's unit j-1 of this tick),
              runs its kernel on the current weights (LWP: on the predicted weights) and stores
              the activations it will need in a ring buffer of depth max(D_s) + 1
    loss      cross entropy of the last units' outputs, mean over the B samples of a member
    backward  positions in reverse: each group gathers output gradients (the loss, the next
              stage's input gradient of the previous tick, or its stage's unit j+1 of this
              tick), reads the activations its members stored D_s ticks ago, and propagates
              through the *current* weights (the ``latest`` policy)
    update    momentum SGD with per-member learning rate, Spike Compensation coefficients and
              LWP horizon, in place on the stacked rows (:mod:`pipetrain.pb.stacked_sgd`)

Units the kernels do not cover run as groups of one through autograd with the ``latest``
hooks (:class:`~pipetrain.pb.latest.LatestWeights`). With one stage (S = 1) there is no delay
and the engine is plain momentum SGD at batch size B, for many runs at once.

Independent runs (seeds, learning rates, compensation methods) of the same model and stage
count are members like stages are, so a whole row of a study trains in one engine.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from pipetrain.errors import ConfigError
from pipetrain.models import refuse_batchnorm
from pipetrain.optim import StageOptimizer
from pipetrain.pb.groups import Group, build_gathers, build_groups
from pipetrain.pb.latest import LatestWeights
from pipetrain.pb.stacked_sgd import StackedSGD
from pipetrain.schedule import pb_delays

__all__ = ["BatchedPB"]


class BatchedPB:
    """Pipelined Backpropagation of many runs at once, tick by tick, stacked per unit structure.

    Args:
        runs: for each independent run, its S stage modules (all runs the same S; stages from
            :func:`pipetrain.stages.split_model`). Parameters are read at construction and
            written back by :meth:`write_back`.
        optimizers: for each run, one :class:`pipetrain.optim.SGD` per stage (momentum, weight
            decay, Nesterov, SC delay, LWP horizon and lr schedule are honoured per stage).
        sample_shape: shape of one input sample (without batch dimension).
        batch_size: samples per member and tick (1 for PB; B > 1 with S = 1 is minibatch SGD).
        dtype: floating-point type of weights and activations.

    A run's float32 result is the same in any engine whose runs share one momentum on every
    stage, and in any engine where they do not (the update then multiplies by a per-member
    column everywhere); :func:`pipetrain.pb.study.run_study` keeps the two kinds apart.

    Raises :class:`~pipetrain.pb.groups.NotBatchable` for what it cannot run (tuple outputs between units, another
    optimizer than SGD, SGD dampening, frozen parameters); the reference engine
    (:func:`pipetrain.pb.pb_sequential`) runs those.
    """

    def __init__(
        self,
        runs: Sequence[Sequence[nn.Module]],
        optimizers: Sequence[Sequence[StageOptimizer]],
        *,
        sample_shape: Sequence[int],
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not runs:
            raise ConfigError("the batched engine needs at least one run")
        self.num_stages = len(runs[0])
        if any(len(r) != self.num_stages for r in runs) or self.num_stages == 0:
            raise ConfigError("all runs of one engine need the same, positive number of stages")
        if len(optimizers) != len(runs) or any(len(o) != self.num_stages for o in optimizers):
            raise ConfigError("give one optimizer per stage of every run")
        self.runs = [list(r) for r in runs]
        self.num_runs = len(runs)
        self.batch_size = int(batch_size)
        self.dtype = dtype
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.delays = pb_delays(self.num_stages)
        for stages in self.runs:
            for stage in stages:
                refuse_batchnorm(stage)
        self.groups = build_groups(self.runs, self.sample_shape, dtype, self.delays)
        self.positions = max(g.position for g in self.groups) + 1
        self.by_position = [[g for g in self.groups if g.position == j] for j in range(self.positions)]
        self.sgd = StackedSGD(self.groups, optimizers, self.num_stages, self.batch_size, dtype)
        self._loss_plan = build_gathers(self.groups, self.num_stages, self.num_runs, self.batch_size, dtype)

    # -- one tick --------------------------------------------------------------------------------

    def _store(self, group: Group, tick: int, saved: list[Tensor]) -> None:
        if group.uniform:  # keep the tensors themselves until their backward
            group.pending[tick % group.ring_depth] = saved
            return
        g = group.size
        if group.ring is None:
            sizes = [t.numel() // g for t in saved]
            group.ring = torch.zeros((group.ring_depth, g, sum(sizes)), dtype=self.dtype)
            group.ring_rows = group.ring.view(group.ring_depth * g, -1)
            # the backward gathers each member's row into one buffer, seen through fixed views
            group.loaded = torch.zeros((g, sum(sizes)), dtype=self.dtype)
            parts = group.loaded.split(sizes, 1)
            group.loaded_views = [p.view(t.shape) for p, t in zip(parts, saved)]  # members first
        torch.cat([t.reshape(g, -1) for t in saved], 1, out=group.ring[tick % group.ring_depth])

    def _load(self, group: Group, tick: int) -> list[Tensor]:
        """The activations each member stored ``D`` ticks ago (valid until the next load)."""
        if group.uniform:
            return group.pending[(tick - group.delays[0]) % group.ring_depth]
        torch.index_select(group.ring_rows, 0, group.read_index[tick % group.ring_depth], out=group.loaded)  # type: ignore[index]
        return group.loaded_views

    def _generic_forward(self, group: Group, tick: int, x: Tensor) -> Tensor:
        member = group.members[0]
        leaves = {n: v[0].detach().requires_grad_(True) for n, v in zip(group.names, group.forward_views)}
        if group.generic is None:  # views of weights updated in place: the same every tick
            current = {n: v[0] for n, v in zip(group.names, group.weights)}
            group.generic = (current, dict(member.module.named_buffers()))
        current, buffers = group.generic
        xin = x[0].detach().requires_grad_(group.need_gx)
        with LatestWeights(leaves, lambda: current):
            out = functional_call(member.module, {**leaves, **buffers}, (xin,))
        group.records[tick] = (xin, out, leaves)
        return out.detach().unsqueeze(0)

    def _generic_backward(self, group: Group, tick: int, gy: Tensor) -> tuple[Tensor | None, list[Tensor]]:
        xin, out, leaves = group.records.pop(tick - group.delays[0])
        targets = ([xin] if group.need_gx else []) + [leaves[n] for n in group.names]
        results = torch.autograd.grad(out, targets, gy[0], allow_unused=True)
        offset = 1 if group.need_gx else 0
        grads = [
            torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(group.names, results[offset:])
        ]
        gx = results[0].unsqueeze(0) if group.need_gx else None
        return gx, [g.unsqueeze(0) for g in grads]

    @staticmethod
    def _record_losses(losses: Tensor, logp: Tensor, targets: Tensor, first: int) -> None:
        """Store the mean loss of the updates ``first, first+1, ...`` (those that exist)."""
        values = -logp.gather(-1, targets[: len(logp)].unsqueeze(-1)).mean((2, 3))
        start, stop = max(first, 0), min(first + len(values), len(losses))
        if start < stop:
            losses[start:stop] = values[start - first : stop - first]

    # -- training --------------------------------------------------------------------------------

    def train(
        self,
        features: Tensor,
        labels: Tensor,
        indices: Tensor,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> Tensor:
        """Train every run on its own sample stream; returns the loss of each update ``[N, R]``.

        ``indices[n, r]`` holds the ``batch_size`` sample indices (into ``features``/``labels``)
        of update n of run r (shape ``[N, R, B]``, or ``[N, R]`` for B = 1). Run r's loss of
        update n is measured by the forward of those samples (on the weights of that moment).
        ``progress(k)`` is called now and then with the number of ticks done since the last call.
        """
        S, R, B = self.num_stages, self.num_runs, self.batch_size
        if indices.dim() == 2:
            indices = indices.unsqueeze(-1)
        if indices.shape[1:] != (R, B):
            raise ConfigError(f"indices must have shape [N, {R}, {B}], got {tuple(indices.shape)}")
        updates = indices.shape[0]
        features = features.to(self.dtype)
        labels = labels.to(torch.int64)
        table = self.sgd.lr_table(updates)
        follow = self.sgd.follow_table(updates, table)
        losses = torch.full((updates, R), float("nan"), dtype=self.dtype)
        tensors: dict[str, list[Any]] = {
            "fprev": [torch.zeros((g.size, B) + g.out_shape, dtype=self.dtype) for g in self.groups],
            "bprev": [torch.zeros((g.size, B) + g.in_shape, dtype=self.dtype) for g in self.groups],
        }
        ticks = updates + 2 * S - 2
        block_logp: Tensor | None = None
        report_every = max(1, min(200, ticks // 100))
        pending = 0
        block = 256  # ticks whose data and rates are prepared at once
        for tick in range(ticks):
            if tick % block == 0:
                span = np.arange(tick, min(tick + block, ticks))
                block_rates, block_valid, block_all, block_momenta = self.sgd.rates(span, updates, table, follow)
                block_x = features[indices[torch.from_numpy(np.minimum(span, updates - 1))]]
                block_y = labels[indices[torch.from_numpy(np.clip(span - S + 1, 0, updates - 1))]]
            k = tick % block
            rates, valid, all_valid = block_rates[k], block_valid[k], bool(block_all[k])
            x = block_x[k]
            tensors["data"] = [x]
            tensors["fcur"] = [None] * len(self.groups)
            tensors["bcur"] = [None] * len(self.groups)
            # forward
            for position in self.by_position:
                for group in position:
                    if group.lwp:  # Linear Weight Prediction: w - lr*T*v
                        horizon = rates[2, group.member_slice]
                        for (_, _, w2, v2), p2 in zip(group.update_views, group.flat_predicted):
                            torch.addcmul(w2, v2, horizon, out=p2)
                    inp = group.in_plan(tensors)
                    if group.kernel is None:
                        out = self._generic_forward(group, tick, inp)
                    else:
                        out, saved = group.kernel.forward(group.forward_context, inp)
                        self._store(group, tick, saved)
                    tensors["fcur"][group.index] = out
            # loss: cross entropy, mean over the B samples of each run (the loss values are
            # taken from the kept log-probabilities once per block of ticks)
            logits = self._loss_plan(tensors)
            if block_logp is None:
                block_logp = torch.empty((block,) + tuple(logits.shape), dtype=self.dtype)
            if k == 0:
                block_target = torch.nn.functional.one_hot(block_y, logits.shape[-1]).to(self.dtype)
                if B > 1:
                    block_target /= B
            logp = torch.log_softmax(logits, -1, out=block_logp[k])
            grad = logp.exp()
            if B > 1:
                grad.div_(B)
            grad.sub_(block_target[k])
            tensors["loss"] = [grad]
            if k == len(span) - 1:
                self._record_losses(losses, block_logp[: k + 1], block_y, tick - k - (S - 1))
            # backward and update
            for position in reversed(self.by_position):
                for group in reversed(position):
                    if group.uniform and not 0 <= tick - group.offset < updates:
                        # one stage (in every run): no sample to propagate in this tick
                        tensors["bcur"][group.index] = group.idle_gradient
                        continue
                    gy = group.grad_plan(tensors)
                    if not all_valid:  # idle members (warm-up, drain) contribute no gradient
                        gy = gy * valid[group.member_slice].view((group.size,) + (1,) * (gy.dim() - 1))
                    if group.kernel is None:
                        gx, grads = self._generic_backward(group, tick, gy)
                    else:
                        saved = self._load(group, tick)
                        gx, grads = group.kernel.backward(group.backward_context, saved, gy, group.need_gx)
                    tensors["bcur"][group.index] = gx
                    if grads:
                        mask = None if all_valid else valid[group.member_slice]
                        momenta = None if not group.following else block_momenta[k][group.member_slice]
                        self.sgd.update(group, grads, rates[:, group.member_slice], mask, momenta)
            tensors["fprev"], tensors["bprev"] = tensors["fcur"], tensors["bcur"]
            pending += 1
            if progress is not None and pending >= report_every:
                progress(pending)
                pending = 0
        if progress is not None and pending:
            progress(pending)
        return losses

    # -- results ---------------------------------------------------------------------------------

    def write_back(self) -> None:
        """Copy the trained weights into every run's stage modules."""
        with torch.no_grad():
            for group in self.groups:
                for row, member in enumerate(group.members):
                    named = dict(member.module.named_parameters())
                    for name, stacked in zip(group.names, group.weights):
                        named[name].copy_(stacked[row])

    def describe(self) -> list[dict[str, Any]]:
        """One entry per group: position, member count, kind (kernel signature or ``generic``)."""
        return [
            {
                "position": g.position,
                "members": g.size,
                "kind": "generic" if g.kernel is None else g.kernel.signature(),
                "parameters_per_member": sum(int(w[0].numel()) for w in g.weights),
            }
            for g in self.groups
        ]
