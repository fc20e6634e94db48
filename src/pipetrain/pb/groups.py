"""The batched PB engine's groups: units of one structure at one position, stacked across members.

A *member* is one (run, stage) pair's unit; a *group* holds the members whose units have the
same kernel and input shape at the same position, with their weights stacked ``[G, *shape]``, the
gathers that assemble its input and output gradient from other groups, and its activation store
(see :mod:`pipetrain.pb.engine`). This module builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from pipetrain.errors import PipetrainError
from pipetrain.pb.kernels import Kernel, materialize
from pipetrain.pb.lowering import lower

__all__ = ["NotBatchable", "stage_units", "Member", "Group", "Gather", "build_groups", "build_gathers",
           "parameter_views"]


class NotBatchable(PipetrainError):
    """The batched engine cannot run this configuration (use the reference engine instead)."""


def stage_units(stage: nn.Module) -> list[nn.Module]:
    """The units of a stage: the children of an ``nn.Sequential`` stage, else the stage itself."""
    if isinstance(stage, nn.Sequential):
        return list(stage.children())
    return [stage]


@dataclass
class Member:
    """One run's stage's unit at ``position`` inside the stage: a row of its group."""

    run: int
    stage: int
    position: int
    module: nn.Module


@dataclass
class Group:
    """Units at one position with one structure: stacked weights, momentum, activation ring."""

    index: int
    position: int
    members: list[Member]
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


def as_matrices(t: Tensor, g: int) -> Tensor:
    """``t`` of ``[G, out, ...]`` as ``[G, out, rest]`` (a convolution's weight as the matrices
    its Outer gradient updates); 2-d and 3-d storage as it is."""
    return t if t.dim() <= 3 else t.view(g, t.shape[1], -1)


def parameter_views(group: Group, storage: Sequence[Tensor]) -> list[Tensor]:
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


class Gather:
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



def probe_shapes(stages: list[nn.Module], sample_shape: tuple[int, ...]) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per stage and unit: the per-sample input and output shapes of one probe sample."""
    first = next((p for stage in stages for p in stage.parameters()), None)
    x = torch.zeros((1,) + sample_shape, dtype=torch.float32 if first is None else first.dtype)
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


def lowered(unit: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
            checked: dict[Any, bool]) -> Kernel | None:
    """``unit``'s kernel for ``in_shape`` if it has one that computes what the module does
    (verdicts kept in ``checked`` by kernel signature and shape)."""
    kernel = lower(unit)
    if kernel is None:
        return None
    try:
        if kernel.bind(in_shape) != out_shape:
            return None
    except PipetrainError:
        return None
    key = (kernel.signature(), in_shape)
    verdict = checked.get(key)
    if verdict is None:
        verdict = kernel_matches(kernel, unit, in_shape)
        checked[key] = verdict
    return kernel if verdict else None


def kernel_matches(kernel: Kernel, unit: nn.Module, in_shape: tuple[int, ...]) -> bool:
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


def build_groups(runs: Sequence[Sequence[nn.Module]], sample_shape: tuple[int, ...], dtype: torch.dtype,
                 delays: Sequence[int]) -> list[Group]:
    """The engine's groups: the units of every run and stage, stacked where their position,
    kernel and input shape agree, generic units alone; ordered by position."""
    checked: dict[Any, bool] = {}
    by_key: dict[Any, list[tuple[Member, Kernel | None, tuple, tuple]]] = {}
    order: list[Any] = []
    for r, stages in enumerate(runs):
        shapes = probe_shapes(stages, sample_shape)
        for s, stage in enumerate(stages):
            for j, unit in enumerate(stage_units(stage)):
                for p in unit.parameters():
                    if not p.requires_grad:
                        raise NotBatchable("the batched engine trains every parameter; freeze none")
                in_shape, out_shape = shapes[s][j]
                kernel = lowered(unit, in_shape, out_shape, checked)
                member = Member(r, s, j, unit)
                if kernel is None:
                    key: Any = ("generic", r, s, j)
                else:
                    key = (j, kernel.signature(), in_shape)
                if key not in by_key:
                    by_key[key] = []
                    order.append(key)
                by_key[key].append((member, kernel, in_shape, out_shape))
    order.sort(key=lambda k: (k[3] if k[0] == "generic" else k[0], 0 if k[0] != "generic" else 1))
    groups: list[Group] = []
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
        group = Group(len(groups), members[0].position, members, kernel, names, shapes,
                       in_shape, out_shape)
        group.need_gx = not all(m.stage == 0 and m.position == 0 for m in members)
        group.delays = [delays[m.stage] for m in members]
        init_weights(group, dtype)
        groups.append(group)
    return groups


def init_weights(group: Group, dtype: torch.dtype) -> None:
    """Stacked weights: each matrix (2-d or more) its own contiguous ``[G, *shape]`` tensor,
    vectors (biases, norm affine) views into one ``[G, P_small]`` slab so that they are
    updated together."""
    g = group.size
    group.small = [i for i, shape in enumerate(group.shapes) if len(shape) < 2]
    group.large = [i for i in range(len(group.shapes)) if i not in group.small]
    slab = sum(math.prod(group.shapes[i]) for i in group.small)
    group.storage_w = [torch.empty((g,) + group.shapes[i], dtype=dtype) for i in group.large]
    if group.small:
        group.storage_w.append(torch.empty((g, slab), dtype=dtype))
    storage_v = [torch.zeros_like(w) for w in group.storage_w]
    weights = parameter_views(group, group.storage_w)
    with torch.no_grad():
        for row, member in enumerate(group.members):
            named = dict(member.module.named_parameters())
            for name, stacked in zip(group.names, weights):
                stacked[row].copy_(named[name].detach())
    group.weights = weights
    group.forward_views = weights
    # (w, v) as the update's matrices (a convolution's [G, out, C, k, k] as [G, out, C*k*k]), and flat
    group.update_views = [(as_matrices(w, g), as_matrices(v, g), w.view(g, -1), v.view(g, -1))
                          for w, v in zip(group.storage_w, storage_v)]


def build_gathers(groups: list[Group], num_stages: int, num_runs: int, batch_size: int,
                  dtype: torch.dtype) -> Gather:
    """Give every group its input and output-gradient gathers and its activation store;
    returns the gather of the last units' outputs (the loss's input)."""
    S = num_stages
    where: dict[tuple[int, int, int], tuple[int, int]] = {}
    last_position: dict[tuple[int, int], int] = {}
    for group in groups:
        for row, m in enumerate(group.members):
            where[(m.run, m.stage, m.position)] = (group.index, row)
            key = (m.run, m.stage)
            last_position[key] = max(last_position.get(key, -1), m.position)
    sizes: dict[tuple[str, int], int] = {("data", 0): num_runs, ("loss", 0): num_runs}
    for group in groups:
        for kind in ("fprev", "fcur", "bprev", "bcur"):
            sizes[(kind, group.index)] = group.size
    for group in groups:
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
        group.in_plan = Gather(inputs, sizes)
        group.grad_plan = Gather(grads, sizes)
    outputs = [("fcur",) + where[(r, S - 1, last_position[(r, S - 1)])] for r in range(num_runs)]
    loss_gather = Gather(outputs, sizes)
    for group in groups:
        depth = max(group.delays) + 1
        group.ring_depth = depth
        group.uniform = len(set(group.delays)) == 1
        group.pending = [None] * depth
        if group.uniform:
            group.offset = 2 * S - 2 - group.members[0].stage
            group.idle_gradient = torch.zeros((group.size, batch_size) + group.in_shape, dtype=dtype)
        if not group.uniform and group.kernel is not None:
            g = group.size
            group.read_index = [
                torch.tensor([((t - d) % depth) * g + i for i, d in enumerate(group.delays)], dtype=torch.int64)
                for t in range(depth)
            ]
    return loss_gather
