"""Which modules the batched engine computes with stacked kernels, and how.

:func:`lower` turns a pipeline unit into a :class:`~pipetrain.pb.kernels.Kernel` when every part
of it is known; any other unit runs through autograd with the generic ``latest`` hooks (one
stage at a time, slower, same semantics). Lowering matches exact types (a subclass of
``nn.Linear`` may override ``forward``), and the engine checks each lowered unit against the
module's own forward on a probe sample before trusting it.

Covered: ``nn.Linear``, ``nn.Conv2d`` (zero padding, numeric padding), ``nn.GroupNorm``,
``nn.LayerNorm``, ``nn.ReLU``, ``nn.GELU``, ``nn.Tanh``, ``nn.Sigmoid``, ``nn.Identity``,
``nn.Flatten``, ``nn.Unflatten``, ``nn.AdaptiveAvgPool2d(1)``, ``nn.Dropout`` with p = 0 or in
eval mode, ``nn.Sequential`` of covered modules, and the built-in residual units
(:class:`pipetrain.models.ResidualBlock`, :class:`pipetrain.models.BasicBlock` and its halves
:class:`~pipetrain.models.BlockHead`, :class:`~pipetrain.models.BlockTail`, the parameter-free
:class:`~pipetrain.models.Shortcut`).
:func:`register_lowering` adds your own.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from pipetrain.models import BasicBlock, BlockHead, BlockTail, ResidualBlock, Shortcut
from pipetrain.pb import block_kernels as blocks
from pipetrain.pb import kernels as K
from pipetrain.pb import layer_kernels as layers

__all__ = ["LOWERINGS", "lower", "register_lowering"]

Lowering = Callable[[nn.Module], "K.Kernel | None"]


def _linear(m: nn.Linear) -> K.Kernel:
    return layers.Linear(m.in_features, m.out_features, m.bias is not None)


def _group_norm(m: nn.GroupNorm) -> K.Kernel:
    return layers.GroupNorm(m.num_groups, m.num_channels, m.eps, m.affine)


def _layer_norm(m: nn.LayerNorm) -> K.Kernel:
    return layers.LayerNorm(tuple(m.normalized_shape), m.eps, m.weight is not None, m.bias is not None)


def _gelu(m: nn.GELU) -> K.Kernel:
    return layers.Activation("gelu", m.approximate)


def _conv2d(m: nn.Conv2d) -> K.Kernel | None:
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        return None
    return layers.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                    m.groups, m.bias is not None)


def _pool(m: nn.AdaptiveAvgPool2d) -> K.Kernel | None:
    size = m.output_size
    return layers.GlobalAvgPool() if size in (1, (1, 1)) else None


def _dropout(m: nn.Dropout) -> K.Kernel | None:
    return layers.Reshape("identity") if m.p == 0 or not m.training else None


def _sequential(m: nn.Sequential) -> K.Kernel | None:
    children = []
    for name, child in m.named_children():
        kernel = lower(child)
        if kernel is None:
            return None
        children.append((name, kernel))
    return blocks.Chain(children)


def _residual_block(m: ResidualBlock) -> K.Kernel | None:
    inner = [("norm", lower(m.norm)), ("fc1", lower(m.fc1)), ("act", lower(m.act)), ("fc2", lower(m.fc2))]
    if any(k is None for _, k in inner):
        return None
    return blocks.Residual(blocks.Chain(inner))  # type: ignore[arg-type]


def _shortcut(m: Shortcut) -> blocks.Shortcut:
    return blocks.Shortcut(m.in_channels, m.out_channels, m.stride)


def _basic_block(m: BasicBlock) -> K.Kernel | None:
    inner = [("conv1", lower(m.conv1)), ("norm1", lower(m.norm1)), ("relu", layers.Activation("relu")),
             ("conv2", lower(m.conv2)), ("norm2", lower(m.norm2))]
    if any(k is None for _, k in inner) or type(m.shortcut) is not Shortcut:
        return None
    short = m.shortcut
    shortcut = None if (short.stride, short.in_channels) == (1, short.out_channels) else _shortcut(short)
    residual = blocks.Residual(blocks.Chain(inner), shortcut)  # type: ignore[arg-type]
    return blocks.Chain([("", residual), ("out", layers.Activation("relu"))])


def _block_head(m: BlockHead) -> K.Kernel | None:
    inner = [("conv1", lower(m.conv1)), ("norm1", lower(m.norm1)), ("relu", layers.Activation("relu"))]
    if any(k is None for _, k in inner) or type(m.shortcut) is not Shortcut:
        return None
    return blocks.Fork(_shortcut(m.shortcut), blocks.Chain(inner))  # type: ignore[arg-type]


def _block_tail(m: BlockTail) -> K.Kernel | None:
    inner = [("conv2", lower(m.conv2)), ("norm2", lower(m.norm2))]
    if any(k is None for _, k in inner):
        return None
    join = blocks.Join(blocks.Chain(inner), m.channels)  # type: ignore[arg-type]
    return blocks.Chain([("", join), ("out", layers.Activation("relu"))])


#: exact module type -> function returning its kernel (or None when the instance is not covered)
LOWERINGS: dict[type, Lowering] = {
    nn.Linear: _linear,
    nn.GroupNorm: _group_norm,
    nn.LayerNorm: _layer_norm,
    nn.ReLU: lambda m: layers.Activation("relu"),
    nn.GELU: _gelu,
    nn.Tanh: lambda m: layers.Activation("tanh"),
    nn.Sigmoid: lambda m: layers.Activation("sigmoid"),
    nn.Identity: lambda m: layers.Reshape("identity"),
    nn.Flatten: lambda m: layers.Reshape("flatten", m.start_dim, m.end_dim),
    nn.Unflatten: lambda m: layers.Reshape("unflatten", start=m.dim, sizes=tuple(m.unflattened_size)),
    nn.Conv2d: _conv2d,
    nn.AdaptiveAvgPool2d: _pool,
    nn.Dropout: _dropout,
    nn.Sequential: _sequential,
    ResidualBlock: _residual_block,
    BasicBlock: _basic_block,
    BlockHead: _block_head,
    BlockTail: _block_tail,
    Shortcut: _shortcut,
}


def register_lowering(module_type: type, lowering: Lowering) -> None:
    """Teach the batched engine a module type: ``lowering(module)`` returns a Kernel or None.

    The kernel's parameter names must be the module's ``named_parameters()`` names.
    """
    LOWERINGS[module_type] = lowering


def lower(module: nn.Module) -> K.Kernel | None:
    """The kernel computing ``module``, or None if some part of it is not covered."""
    lowering = LOWERINGS.get(type(module))
    if lowering is None:
        return None
    if any(True for _ in module.buffers(recurse=False)):
        return None
    kernel = lowering(module)
    if kernel is None:
        return None
    names = [name for name, _ in module.named_parameters()]
    if sorted(names) != sorted(name for name, _ in kernel.params):
        return None
    return kernel
