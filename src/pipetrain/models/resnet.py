"""`resnet-gn`: a residual CNN with GroupNorm for small images, cut by block or by convolution."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models.common import check_choice, check_int, input_features, make_norm

__all__ = ["BasicBlock", "BlockHead", "BlockTail", "Shortcut", "image_shape", "resnet_gn"]


class Shortcut(nn.Module):
    """The parameter-free shortcut of a block (He et al.'s CIFAR "option A"): identity, or
    every ``stride``-th pixel with the new channels zero where the block widens."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        if out_channels < in_channels:
            raise ConfigError(f"a shortcut cannot narrow {in_channels} channels to {out_channels}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.out_channels != self.in_channels:
            x = nn.functional.pad(x, (0, 0, 0, 0, 0, self.out_channels - self.in_channels))
        return x

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, stride={self.stride}"


def _convs(cin: int, cout: int, stride: int, groups: int) -> tuple[nn.Module, ...]:
    return (
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        make_norm("resnet-gn", "group", cout, groups),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        make_norm("resnet-gn", "group", cout, groups),
    )


class BasicBlock(nn.Module):
    """``relu(shortcut(x) + gn(conv(relu(gn(conv(x))))))``; the first convolution may widen the
    channels and stride (the :class:`Shortcut` follows), the second keeps them."""

    def __init__(self, channels: int, groups: int, *, out_channels: int | None = None, stride: int = 1):
        super().__init__()
        out = channels if out_channels is None else out_channels
        self.conv1, self.norm1, self.conv2, self.norm2 = _convs(channels, out, stride, groups)
        self.shortcut = Shortcut(channels, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.shortcut(x) + self.norm2(self.conv2(y)))


class BlockHead(nn.Module):
    """The first convolution of a :class:`BasicBlock` as a unit of its own: returns
    ``cat(shortcut(x), relu(gn(conv(x))))`` on the channels, so that the shortcut travels with
    the activations to the :class:`BlockTail` (pipeline units pass one tensor)."""

    def __init__(self, channels: int, groups: int, *, out_channels: int | None = None, stride: int = 1):
        super().__init__()
        out = channels if out_channels is None else out_channels
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm("resnet-gn", "group", out, groups)
        self.shortcut = Shortcut(channels, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.shortcut(x), torch.relu(self.norm1(self.conv1(x)))], 1)


class BlockTail(nn.Module):
    """The second convolution of a :class:`BasicBlock`: ``relu(s + gn(conv(h)))`` of the
    :class:`BlockHead` output ``cat(s, h)``."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.channels = channels
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = make_norm("resnet-gn", "group", channels, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut, y = x[:, : self.channels], x[:, self.channels :]
        return torch.relu(shortcut + self.norm2(self.conv2(y)))


def image_shape(input_shape: Sequence[int] | int) -> tuple[int, int, int]:
    """``(C, H, W)`` of a sample: 3-d as is, 2-d as one channel, flat square vectors as (1, s, s)."""
    shape, features = input_features(input_shape)
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    side = math.isqrt(features)
    if len(shape) == 1 and side * side == features:
        return (1, side, side)
    raise ConfigError(
        f"model resnet-gn needs image input (C, H, W), (H, W) or a flat square vector such as "
        f"digits' 64 = 8x8 features; got input shape {shape}"
    )


def _widths(widths: Sequence[int] | int | None, channels: int) -> list[int]:
    if widths is None:
        return [channels]
    values = [widths] if isinstance(widths, int) else list(widths)
    if not values or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in values):
        raise ConfigError(
            f"model resnet-gn: widths must be positive channel counts, e.g. widths=16/32/64, got {widths!r}"
        )
    if any(b < a for a, b in zip(values, values[1:])):
        raise ConfigError(f"model resnet-gn: widths must not shrink (the shortcut pads channels), got {widths!r}")
    return values


def resnet_gn(
    input_shape: Sequence[int] | int,
    num_classes: int,
    depth: int = 4,
    channels: int | None = None,
    groups: int = 4,
    widths: Sequence[int] | int | None = None,
    units: str = "block",
    zero_init: bool = False,
) -> nn.Sequential:
    """Stem, ``depth`` :class:`BasicBlock` s per width, pooled Linear head; no BatchNorm anywhere.

    ``widths`` (e.g. ``widths=16/32/64`` in a spec; default: ``channels``, 16, alone) are the channels
    of the layers of blocks; every layer after the first halves the resolution in its first block
    (stride 2, :class:`Shortcut` padding the new channels with zeros). ``widths=16/32/64,depth=3``
    is ResNet-20's layout (19 convolutions and the head). ``zero_init`` starts the last GroupNorm
    of every block at weight 0, so that each block starts as its shortcut (Goyal et al. 2017).

    Top-level children (the pipeline units) with ``units=block``, ``L*depth + 2`` of them (L
    widths)::

        0              Sequential([Unflatten to (1, s, s)], Conv3x3(C, widths[0]), GroupNorm, ReLU)
        1 .. L*depth   BasicBlock
        last           Sequential(AdaptiveAvgPool2d(1), Flatten, Linear(widths[-1], num_classes))

    With ``units=conv`` every block is two units, :class:`BlockHead` and :class:`BlockTail` (one
    convolution each, the same arithmetic), ``2*L*depth + 2`` units: every layer can be a stage.
    """
    depth = check_int("resnet-gn", "depth", depth, 0)
    if channels is not None and widths is not None:
        raise ConfigError("model resnet-gn: give channels (one width) or widths (one per layer), not both")
    channels = check_int("resnet-gn", "channels", 16 if channels is None else channels, 1)
    groups = check_int("resnet-gn", "groups", groups, 1)
    units = check_choice("resnet-gn", "units", units, ("block", "conv"))
    if not isinstance(zero_init, bool):
        raise ConfigError(f"model resnet-gn: zero_init must be true or false, got {zero_init!r}")
    layers = _widths(widths, channels)
    c, h, w = image_shape(input_shape)
    if min(h, w) < 2 ** (len(layers) - 1):
        raise ConfigError(
            f"model resnet-gn: {len(layers)} widths halve {h}x{w} images {len(layers) - 1} times; "
            f"give at most {min(h, w).bit_length()} widths"
        )
    shape, _ = input_features(input_shape)
    reshape: list[nn.Module] = [] if len(shape) == 3 else [nn.Unflatten(1, (c, h, w))]
    stem = nn.Sequential(
        *reshape,
        nn.Conv2d(c, layers[0], 3, padding=1, bias=False),
        make_norm("resnet-gn", "group", layers[0], groups),
        nn.ReLU(),
    )
    modules: list[nn.Module] = [stem]
    width = layers[0]
    for i, out in enumerate(layers):
        for j in range(depth):
            stride = 2 if i > 0 and j == 0 else 1
            if units == "block":
                block = BasicBlock(width, groups, out_channels=out, stride=stride)
                last_norm = block.norm2
                modules.append(block)
            else:
                head = BlockHead(width, groups, out_channels=out, stride=stride)  # created first: same
                tail = BlockTail(out, groups)  # initial weights as units=block for a seed
                last_norm = tail.norm2
                modules += [head, tail]
            if zero_init:
                nn.init.zeros_(last_norm.weight)
            width = out
    modules.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)))
    return nn.Sequential(*modules)
