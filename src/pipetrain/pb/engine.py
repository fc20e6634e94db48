"""The batched PB engine: the tick-by-tick pipeline with all stages (and runs) computed together.

In tick t of Pipelined Backpropagation stage s runs the forward of sample ``t - s`` and the
backward of sample ``t - (2S-2-s)``, independently of the other stages. So the engine computes,
in each tick, the same unit of every stage of every run as one stacked operation (see
:mod:`pipetrain.pb.kernels`): a *member* is one (run, stage) pair, and the units at position j
inside their stages that have the same structure form a *group* whose weights are stacked
``[G, P]`` (one flat row per member). Python overhead is then paid per group, not per stage:
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
              LWP horizon, in place on the stacked rows

Units the kernels do not cover run as groups of one through autograd with the ``latest``
hooks (:class:`~pipetrain.pb.latest.LatestWeights`). With one stage (S = 1) there is no delay
and the engine is plain momentum SGD at batch size B, for many runs at once.

Independent runs (seeds, learning rates, compensation methods) of the same model and stage
count are members like stages are, so a whole row of a study trains in one engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.models import refuse_batchnorm
from pipetrain.optim import SGD, StageOptimizer, spike_coefficients
from pipetrain.optim.sgd import RateFollowingSGD
from pipetrain.pb.kernels import Kernel, Outer, materialize
from pipetrain.pb.latest import LatestWeights
from pipetrain.pb.lowering import lower
from pipetrain.schedule import pb_delays

__all__ = ["BatchedPB", "NotBatchable", "stage_units"]


class NotBatchable(PipetrainError):
    """The batched engine cannot run this configuration (use the reference engine instead)."""


def stage_units(stage: nn.Module) -> list[nn.Module]:
    """The units of a stage: the children of an ``nn.Sequential`` stage, else the stage itself."""
    if isinstance(stage, nn.Sequential):
        return list(stage.children())
    return [stage]


@dataclass
class _Member:
    run: int
    stage: int
    position: int
    module: nn.Module


@dataclass
class _Group:
    """Units at one position with one structure: stacked weights, momentum, activation ring."""

    index: int
    position: int
    members: list[_Member]
    kernel: Kernel | None  # None: generic autograd unit (one member)
    names: list[str]
    shapes: list[tuple[int, ...]]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weights: list[Tensor] = field(default_factory=list)  # per parameter, [G, *shape], contiguous
    forward_views: list[Tensor] = field(default_factory=list)  # what forward reads (weights, or LWP's)
    forward_context: Any = None  # kernel.prepare(forward_views)
    backward_context: Any = None  # kernel.prepare(views)
    need_gx: bool = True
    delays: list[int] = field(default_factory=list)
    member_slice: slice = field(default_factory=lambda: slice(0, 0))
    in_plan: Any = None
    grad_plan: Any = None
    # activation ring
    ring: Tensor | None = None
    ring_depth: int = 1
    read_index: list[Tensor] | None = None
    ring_rows: Tensor | None = None  # the ring as [depth * G, K] rows
    loaded: Tensor | None = None  # [G, K] rows gathered for this tick's backward
    loaded_views: list[Tensor] = field(default_factory=list)  # the saved tensors, as views of `loaded`
    records: dict[int, Any] = field(default_factory=dict)
    # optimizer options of the group's members (shapes [G, 1])
    momentum: Tensor | float = 0.0
    weight_decay: Tensor | None = None
    spike: bool = False
    following: bool = False  # holds rate-following members: momentum per update, not fixed
    lwp: bool = False
    small: list[int] = field(default_factory=list)  # parameters kept in the vector slab
    large: list[int] = field(default_factory=list)  # parameters kept as their own tensors
    storage_w: list[Tensor] = field(default_factory=list)  # large weights, then the slab
    update_views: list[tuple[Tensor, Tensor, Tensor, Tensor]] = field(default_factory=list)  # w, v, [G,-1] views
    flat_predicted: list[Tensor] = field(default_factory=list)
    uniform: bool = True  # all members have the same delay (so they are the same stage)
    offset: int = 0  # uniform groups: the tick of the backward of sample n is n + offset
    idle_gradient: Tensor | None = None  # input gradient passed on in ticks without a backward
    pending: list[Any] = field(default_factory=list)  # saved activations by tick (uniform delay)
    generic: tuple[dict, dict] | None = None  # generic units: current weights and buffers by name

    @property
    def size(self) -> int:
        return len(self.members)


def _as_matrices(t: Tensor, g: int) -> Tensor:
    """``t`` of ``[G, out, ...]`` as ``[G, out, rest]`` (a convolution's weight as the matrices
    its Outer gradient updates); 2-d and 3-d storage as it is."""
    return t if t.dim() <= 3 else t.view(g, t.shape[1], -1)


def _parameter_views(group: _Group, storage: Sequence[Tensor]) -> list[Tensor]:
    """Per-parameter ``[G, *shape]`` views of storage laid out as ``group.storage_w`` is: the
    large parameters' own tensors, then one slab holding the small ones in order."""
    views: list[Tensor] = [None] * len(group.shapes)  # type: ignore[list-item]
    for i, tensor in zip(group.large, storage):
        views[i] = tensor
    offset = 0
    for i in group.small:
        size = math.prod(group.shapes[i])
        views[i] = storage[-1][:, offset : offset + size].view((group.size,) + group.shapes[i])
        offset += size
    return views


def _sgd_options(opt: StageOptimizer) -> tuple[float, float, float, float, float, float, Any]:
    """(lr, momentum, weight_decay, a, b, lwp_horizon, schedule) of a plain SGD stage optimizer
    (of a :class:`RateFollowingSGD`: its base momentum and the coefficients of that momentum)."""
    if type(opt) not in (SGD, RateFollowingSGD):
        raise NotBatchable(f"the batched engine runs momentum SGD only, not {type(opt).__name__}")
    if opt.dampening != 0.0:
        raise NotBatchable("the batched engine does not implement SGD dampening")
    m = opt.base_momentum if isinstance(opt, RateFollowingSGD) else opt.momentum
    if opt.nesterov:
        a, b = m, 1.0
    elif opt.sc_delay:
        a, b = spike_coefficients(m, opt.sc_delay)
    else:
        a, b = 1.0, 0.0
    return opt.lr, m, opt.weight_decay, a, b, opt.lwp_horizon, opt.lr_schedule


class _Plan:
    """How a group's input (or output gradient) is assembled from its members' sources."""

    __slots__ = ("mode", "parts", "index")

    def __init__(self, sources: list[tuple[str, int, int]], sizes: dict[tuple[str, int], int]):
        # sources: per destination member (kind, group, row); consecutive rows form segments
        segments: list[list[Any]] = []
        for kind, group, row in sources:
            last = segments[-1] if segments else None
            if last is not None and last[0] == kind and last[1] == group and last[3] == row:
                last[3] = row + 1
            else:
                segments.append([kind, group, row, row + 1])
        keys = {(s[0], s[1]) for s in segments}
        self.index = None
        if len(segments) == 1:
            kind, group, start, stop = segments[0]
            whole = start == 0 and stop == sizes[(kind, group)]
            self.mode = "whole" if whole else "slice"
            self.parts = [(kind, group, start, stop)]
        elif len(keys) == 1:
            kind, group = keys.pop()
            self.mode = "index"
            self.parts = [(kind, group, 0, 0)]
            self.index = torch.tensor([row for _, _, row in sources], dtype=torch.int64)
        else:
            self.mode = "cat"
            self.parts = [tuple(s) for s in segments]

    def __call__(self, tensors: dict[str, list[Tensor | None]]) -> Tensor:
        if self.mode == "whole":
            kind, group, _, _ = self.parts[0]
            return tensors[kind][group]  # type: ignore[return-value]
        if self.mode == "slice":
            kind, group, start, stop = self.parts[0]
            return tensors[kind][group][start:stop]  # type: ignore[index]
        if self.mode == "index":
            kind, group, _, _ = self.parts[0]
            return tensors[kind][group].index_select(0, self.index)  # type: ignore[union-attr]
        return torch.cat([tensors[k][g][a:b] for k, g, a, b in self.parts])  # type: ignore[index]


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

    Raises :class:`NotBatchable` for what it cannot run (tuple outputs between units, another
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
        self._build_groups()
        self._build_optimizer(optimizers)
        self._build_plans()

    # -- construction ----------------------------------------------------------------------------

    def _probe_shapes(self, stages: list[nn.Module]) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        first = next((p for stage in stages for p in stage.parameters()), None)
        x = torch.zeros((1,) + self.sample_shape, dtype=torch.float32 if first is None else first.dtype)
        shapes = []
        with torch.no_grad():
            for stage in stages:
                per_unit = []
                for unit in stage_units(stage):
                    if not isinstance(x, Tensor):
                        raise NotBatchable("the batched engine passes one tensor between units")
                    y = unit(x)
                    if not isinstance(y, Tensor):
                        raise NotBatchable(
                            f"unit {type(unit).__name__} returns {type(y).__name__}; the batched "
                            "engine passes one tensor between units"
                        )
                    per_unit.append((tuple(x.shape[1:]), tuple(y.shape[1:])))
                    x = y
                shapes.append(per_unit)
        return shapes

    def _lower_checked(self, unit: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        kernel = lower(unit)
        if kernel is None:
            return None
        try:
            if kernel.bind(in_shape) != out_shape:
                return None
        except PipetrainError:
            return None
        key = (kernel.signature(), in_shape)
        verdict = self._checked.get(key)
        if verdict is None:
            verdict = self._check_kernel(kernel, unit, in_shape)
            self._checked[key] = verdict
        return kernel if verdict else None

    def _check_kernel(self, kernel: Kernel, unit: nn.Module, in_shape: tuple[int, ...]) -> bool:
        """Does the kernel compute what the module computes (forward and backward)?"""
        gen = torch.Generator().manual_seed(0)
        dtype = torch.float64
        x = torch.randn((2,) + in_shape, generator=gen, dtype=dtype)
        params = {n: p.detach().to(dtype) for n, p in unit.named_parameters()}
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        xin = x.clone().requires_grad_(True)
        try:
            ref = functional_call(unit, leaves, (xin,))
            gy = torch.randn(ref.shape, generator=gen, dtype=dtype)
            ref_grads = torch.autograd.grad(ref, [xin] + [leaves[n] for n, _ in kernel.params], gy)
            context = kernel.prepare([params[n].unsqueeze(0) for n, _ in kernel.params])
            y, saved = kernel.forward(context, x.unsqueeze(0))
            gx, grads = kernel.backward(context, saved, gy.unsqueeze(0), True)
            grads = [materialize(g) for g in grads]
        except RuntimeError:
            return False
        close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-10)  # noqa: E731
        return (
            close(y[0], ref)
            and close(gx[0], ref_grads[0])
            and all(close(g[0], r) for g, r in zip(grads, ref_grads[1:]))
        )

    def _build_groups(self) -> None:
        self._checked: dict[Any, bool] = {}
        by_key: dict[Any, list[tuple[_Member, Kernel | None, tuple, tuple]]] = {}
        order: list[Any] = []
        for r, stages in enumerate(self.runs):
            shapes = self._probe_shapes(stages)
            for s, stage in enumerate(stages):
                for j, unit in enumerate(stage_units(stage)):
                    for p in unit.parameters():
                        if not p.requires_grad:
                            raise NotBatchable("the batched engine trains every parameter; freeze none")
                    in_shape, out_shape = shapes[s][j]
                    kernel = self._lower_checked(unit, in_shape, out_shape)
                    member = _Member(r, s, j, unit)
                    if kernel is None:
                        key: Any = ("generic", r, s, j)
                    else:
                        key = (j, kernel.signature(), in_shape)
                    if key not in by_key:
                        by_key[key] = []
                        order.append(key)
                    by_key[key].append((member, kernel, in_shape, out_shape))
        order.sort(key=lambda k: (k[3] if k[0] == "generic" else k[0], 0 if k[0] != "generic" else 1))
        self.groups: list[_Group] = []
        for key in order:
            entries = sorted(by_key[key], key=lambda e: (e[0].run, e[0].stage))
            members = [e[0] for e in entries]
            kernel, in_shape, out_shape = entries[0][1], entries[0][2], entries[0][3]
            if kernel is None:
                named = list(members[0].module.named_parameters())
                names = [n for n, _ in named]
                shapes = [tuple(p.shape) for _, p in named]
            else:
                names = [n for n, _ in kernel.params]
                shapes = [tuple(s) for _, s in kernel.params]
            group = _Group(len(self.groups), members[0].position, members, kernel, names, shapes,
                           in_shape, out_shape)
            group.need_gx = not all(m.stage == 0 and m.position == 0 for m in members)
            group.delays = [self.delays[m.stage] for m in members]
            self._init_weights(group)
            self.groups.append(group)
        self.positions = max(g.position for g in self.groups) + 1
        self.by_position = [[g for g in self.groups if g.position == j] for j in range(self.positions)]

    def _init_weights(self, group: _Group) -> None:
        """Stacked weights: each matrix (2-d or more) its own contiguous ``[G, *shape]`` tensor,
        vectors (biases, norm affine) views into one ``[G, P_small]`` slab so that they are
        updated together."""
        g = group.size
        group.small = [i for i, shape in enumerate(group.shapes) if len(shape) < 2]
        group.large = [i for i in range(len(group.shapes)) if i not in group.small]
        slab = sum(math.prod(group.shapes[i]) for i in group.small)
        group.storage_w = [torch.empty((g,) + group.shapes[i], dtype=self.dtype) for i in group.large]
        if group.small:
            group.storage_w.append(torch.empty((g, slab), dtype=self.dtype))
        storage_v = [torch.zeros_like(w) for w in group.storage_w]
        weights = _parameter_views(group, group.storage_w)
        with torch.no_grad():
            for row, member in enumerate(group.members):
                named = dict(member.module.named_parameters())
                for name, stacked in zip(group.names, weights):
                    stacked[row].copy_(named[name].detach())
        group.weights = weights
        group.forward_views = weights
        # (w, v) as the update's matrices (a convolution's [G, out, C, k, k] as [G, out, C*k*k]), and flat
        group.update_views = [(_as_matrices(w, g), _as_matrices(v, g), w.view(g, -1), v.view(g, -1))
                              for w, v in zip(group.storage_w, storage_v)]

    def _build_optimizer(self, optimizers: Sequence[Sequence[StageOptimizer]]) -> None:
        schedules: list[Any] = []
        offsets, lrs, a_list, b_list, horizons, schedule_ids = [], [], [], [], [], []
        follow_keys: list[tuple] = []  # per member: what its per-update (factor, m, a, b) depend on
        followers: dict[tuple, RateFollowingSGD] = {}  # one optimizer of each rate-following key
        start = 0
        every_momentum: set[float] = set()
        for group in self.groups:
            momenta, decays, a_g, b_g, t_g = [], [], [], [], []
            for member in group.members:
                opt = optimizers[member.run][member.stage]
                lr, m, wd, a, b, horizon, schedule = _sgd_options(opt)
                if schedule not in schedules:
                    schedules.append(schedule)
                if isinstance(opt, RateFollowingSGD):
                    key = ("follow", schedules.index(schedule), m, opt.stage_delay, opt.reference_delay, opt.sc_delay)
                    follow_keys.append(key)
                    followers.setdefault(key, opt)
                else:
                    follow_keys.append(("constant", m, a, b))
                schedule_ids.append(schedules.index(schedule))
                offsets.append(2 * self.num_stages - 2 - member.stage)
                lrs.append(lr)
                momenta.append(m)
                decays.append(wd)
                a_g.append(a)
                b_g.append(b)
                t_g.append(horizon)
            column = lambda v: torch.tensor(v, dtype=self.dtype).unsqueeze(1)  # noqa: E731
            group.momentum = column(momenta)
            every_momentum.update(momenta)
            group.following = any(key[0] == "follow" for key in follow_keys[start : start + group.size])
            group.weight_decay = column(decays) if any(decays) else None
            group.spike = not (all(a == 1.0 for a in a_g) and not any(b_g))
            group.lwp = any(t > 0 for t in t_g)
            if group.lwp:
                storage = [w.clone() for w in group.storage_w]
                group.flat_predicted = [w.view(group.size, -1) for w in storage]
                group.forward_views = _parameter_views(group, storage)
            if group.kernel is not None:
                group.forward_context = group.kernel.prepare(group.forward_views)
                group.backward_context = group.kernel.prepare(group.weights)
            group.member_slice = slice(start, start + group.size)
            start += group.size
            a_list.extend(a_g)
            b_list.extend(b_g)
            horizons.extend(t_g)
        self._schedules = schedules
        self._offsets = np.array(offsets, dtype=np.int64)
        # One momentum for every member: the fused scalar update. Otherwise every group multiplies
        # by a column, also where its own members agree, so that a run's bits depend only on
        # whether the engine's runs share one momentum, never on which runs they are.
        # (rate-following members change their momentum per update: never one momentum)
        if len(every_momentum) == 1 and not followers:
            for group in self.groups:
                group.momentum = next(iter(every_momentum))
        self._base_lr = np.array(lrs, dtype=np.float64)
        self._coefficients = np.array([a_list, b_list, horizons], dtype=np.float64)
        self._schedule_ids = np.array(schedule_ids, dtype=np.int64)
        # rate-following members (dtsf): factor, momentum and spike coefficients change per update
        self._follow_keys, self._followers = None, followers
        if followers:
            distinct = list(dict.fromkeys(follow_keys))
            self._follow_keys = distinct
            self._follow_ids = np.array([distinct.index(key) for key in follow_keys], dtype=np.int64)
            self._horizons = np.array(horizons, dtype=np.float64)

    def _build_plans(self) -> None:
        S = self.num_stages
        where: dict[tuple[int, int, int], tuple[int, int]] = {}
        last_position: dict[tuple[int, int], int] = {}
        for group in self.groups:
            for row, m in enumerate(group.members):
                where[(m.run, m.stage, m.position)] = (group.index, row)
                key = (m.run, m.stage)
                last_position[key] = max(last_position.get(key, -1), m.position)
        sizes: dict[tuple[str, int], int] = {("data", 0): self.num_runs, ("loss", 0): self.num_runs}
        for group in self.groups:
            for kind in ("fprev", "fcur", "bprev", "bcur"):
                sizes[(kind, group.index)] = group.size
        for group in self.groups:
            inputs, grads = [], []
            for m in group.members:
                if m.position > 0:
                    inputs.append(("fcur",) + where[(m.run, m.stage, m.position - 1)])
                elif m.stage > 0:
                    prev = (m.run, m.stage - 1, last_position[(m.run, m.stage - 1)])
                    inputs.append(("fprev",) + where[prev])
                else:
                    inputs.append(("data", 0, m.run))
                if m.position < last_position[(m.run, m.stage)]:
                    grads.append(("bcur",) + where[(m.run, m.stage, m.position + 1)])
                elif m.stage < S - 1:
                    grads.append(("bprev",) + where[(m.run, m.stage + 1, 0)])
                else:
                    grads.append(("loss", 0, m.run))
            group.in_plan = _Plan(inputs, sizes)
            group.grad_plan = _Plan(grads, sizes)
        outputs = [("fcur",) + where[(r, S - 1, last_position[(r, S - 1)])] for r in range(self.num_runs)]
        self._loss_plan = _Plan(outputs, sizes)
        for group in self.groups:
            depth = max(group.delays) + 1
            group.ring_depth = depth
            group.uniform = len(set(group.delays)) == 1
            group.pending = [None] * depth
            if group.uniform:
                group.offset = 2 * S - 2 - group.members[0].stage
                group.idle_gradient = torch.zeros((group.size, self.batch_size) + group.in_shape, dtype=self.dtype)
            if not group.uniform and group.kernel is not None:
                g = group.size
                group.read_index = [
                    torch.tensor([((t - d) % depth) * g + i for i, d in enumerate(group.delays)], dtype=torch.int64)
                    for t in range(depth)
                ]

    # -- one tick --------------------------------------------------------------------------------

    def _store(self, group: _Group, tick: int, saved: list[Tensor]) -> None:
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

    def _load(self, group: _Group, tick: int) -> list[Tensor]:
        """The activations each member stored ``D`` ticks ago (valid until the next load)."""
        if group.uniform:
            return group.pending[(tick - group.delays[0]) % group.ring_depth]
        torch.index_select(group.ring_rows, 0, group.read_index[tick % group.ring_depth], out=group.loaded)  # type: ignore[index]
        return group.loaded_views

    def _generic_forward(self, group: _Group, tick: int, x: Tensor) -> Tensor:
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

    def _generic_backward(self, group: _Group, tick: int, gy: Tensor) -> tuple[Tensor | None, list[Tensor]]:
        xin, out, leaves = group.records.pop(tick - group.delays[0])
        targets = ([xin] if group.need_gx else []) + [leaves[n] for n in group.names]
        results = torch.autograd.grad(out, targets, gy[0], allow_unused=True)
        offset = 1 if group.need_gx else 0
        grads = [
            torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(group.names, results[offset:])
        ]
        gx = results[0].unsqueeze(0) if group.need_gx else None
        return gx, [g.unsqueeze(0) for g in grads]

    def _update(self, group: _Group, grads: list, rates: Tensor, valid: Tensor | None,
                momenta: Tensor | None = None) -> None:
        """Momentum SGD (+ SC) on the group's rows, one weight tensor at a time (cache friendly).

        ``rates`` is ``[3, G, 1]``: ``-lr*a``, ``-lr*b`` and ``-lr*T`` per member, where
        ``(a, b)`` are the spike coefficients (``(1, 0)`` without SC). With
        ``g = grad + weight_decay*w``: ``v <- m*v + g``, ``w <- w - lr*(a*v + b*g)``.

        In the ticks where some members have no sample (pipeline warm-up and drain), ``valid``
        marks the others: the rates of the idle ones are 0 (their weights stay), their output
        gradient was zeroed (so in warm-up their momentum stays 0), and so is their decay. Their
        momentum may still shrink in the drain, when no update follows. ``momenta`` (``[G, 1]``)
        replaces the group's momentum for this update (rate-following members).
        """
        g = group.size
        momentum, decay, spike = group.momentum if momenta is None else momenta, group.weight_decay, group.spike
        if valid is not None and decay is not None:
            decay = decay * valid  # members without a sample this tick: no decay either
        scalar = not isinstance(momentum, Tensor)
        step_v, step_g = rates[0], rates[1]
        pairs = [grads[i] for i in group.large]
        if group.small:
            small = [grads[i] for i in group.small]
            pairs.append(torch.cat([t if t.dim() == 2 else materialize(t).reshape(g, -1) for t in small], 1))
        for grad, (w, v, w2, v2) in zip(pairs, group.update_views):
            if isinstance(grad, Outer) and not (spike and decay is not None):
                # v <- m*v + a @ b without materialising the gradient
                if scalar:
                    v.baddbmm_(grad.a, grad.b, beta=momentum)
                else:
                    v2.mul_(momentum)
                    v.baddbmm_(grad.a, grad.b)
                if decay is not None:
                    v2.addcmul_(w2, decay)
                w2.addcmul_(v2, step_v)
                if spike:
                    w.baddbmm_(grad.a * step_g.view(g, 1, 1), grad.b)
                continue
            grad2 = materialize(grad).reshape(g, -1)
            if decay is not None:
                grad2 = torch.addcmul(grad2, w2, decay)
            if scalar:
                torch.add(grad2, v2, alpha=momentum, out=v2)  # v <- m*v + g
            else:
                v2.mul_(momentum).add_(grad2)
            w2.addcmul_(v2, step_v)
            if spike:
                w2.addcmul_(grad2, step_g)

    @staticmethod
    def _record_losses(losses: Tensor, logp: Tensor, targets: Tensor, first: int) -> None:
        """Store the mean loss of the updates ``first, first+1, ...`` (those that exist)."""
        values = -logp.gather(-1, targets[: len(logp)].unsqueeze(-1)).mean((2, 3))
        start, stop = max(first, 0), min(first + len(values), len(losses))
        if start < stop:
            losses[start:stop] = values[start - first : stop - first]

    def _rates(self, ticks: np.ndarray, updates: int, table: np.ndarray,
               follow: np.ndarray | None = None) -> tuple[Tensor, Tensor, np.ndarray, Tensor | None]:
        """For a block of ticks: ``[n, 3, M, 1]`` update rates of every member (0 for members
        without a sample), the validity mask ``[n, M, 1]``, per tick whether all are valid, and
        (with rate-following members, ``follow`` from :meth:`_follow_table`) the momentum of
        every member's update ``[n, M, 1]``, else None."""
        step = ticks[:, None] - self._offsets[None, :]
        valid = (step >= 0) & (step < updates)
        clipped = np.clip(step, 0, updates - 1)
        numpy_dtype = np.float32 if self.dtype == torch.float32 else np.float64
        momenta = None
        if follow is None:
            lr = self._base_lr * table[self._schedule_ids, clipped] * valid
            rates = -(lr[:, None, :] * self._coefficients[None])
        else:
            settings = follow[self._follow_ids[None, :], :, clipped]  # [n, M, 4]: factor, m, a, b
            lr = self._base_lr * table[self._schedule_ids, clipped] * settings[..., 0] * valid
            coefficients = np.stack([settings[..., 2], settings[..., 3],
                                     np.broadcast_to(self._horizons, lr.shape)], 1)  # [n, 3, M]
            rates = -(lr[:, None, :] * coefficients)
            momenta = torch.from_numpy(settings[..., 1].astype(numpy_dtype)).unsqueeze(-1)
        rates_t = torch.from_numpy(rates.astype(numpy_dtype)).unsqueeze(-1)
        valid_t = torch.from_numpy(valid.astype(numpy_dtype)).unsqueeze(-1)
        return rates_t, valid_t, valid.all(1), momenta

    # -- training --------------------------------------------------------------------------------

    def _follow_table(self, updates: int, table: np.ndarray) -> np.ndarray | None:
        """``[K, 4, updates]``: (lr factor, momentum, a, b) of each distinct member setting per
        update, as :class:`~pipetrain.optim.sgd.RateFollowingSGD` takes them at that update's lr
        schedule factor (constant for the members that do not follow the rate); None without
        rate-following members."""
        if self._follow_keys is None:
            return None
        out = np.empty((len(self._follow_keys), 4, updates), dtype=np.float64)
        for i, key in enumerate(self._follow_keys):
            if key[0] == "constant":
                out[i] = np.array([1.0, key[1], key[2], key[3]])[:, None]
                continue
            follower, schedule_id = self._followers[key], key[1]
            for n in range(updates):
                out[i, :, n] = follower.settings_for(float(table[schedule_id, n]))
        return out

    def _lr_table(self, updates: int) -> np.ndarray:
        table = np.empty((len(self._schedules), updates), dtype=np.float64)
        for i, schedule in enumerate(self._schedules):
            table[i] = [schedule.factor(n * self.batch_size) for n in range(updates)]
        return table

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
        table = self._lr_table(updates)
        follow = self._follow_table(updates, table)
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
                block_rates, block_valid, block_all, block_momenta = self._rates(span, updates, table, follow)
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
                        self._update(group, grads, rates[:, group.member_slice], mask, momenta)
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
