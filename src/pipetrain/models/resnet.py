"""`resnet-gn`: a small residual CNN with GroupNorm for small single-channel images."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models.common import check_int, input_features, make_norm

__all__ = ["BasicBlock", "image_shape", "resnet_gn"]


class BasicBlock(nn.Module):
    """``relu(x + gn(conv(relu(gn(conv(x))))))`` at constant channels and resolution."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = make_norm("resnet-gn", "group", channels, groups)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = make_norm("resnet-gn", "group", channels, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(y)))


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


def resnet_gn(
    input_shape: Sequence[int] | int,
    num_classes: int,
    depth: int = 4,
    channels: int = 16,
    groups: int = 4,
) -> nn.Sequential:
    """Stem, ``depth`` :class:`BasicBlock` s, pooled Linear head; no BatchNorm anywhere.

    Top-level children (the pipeline units), ``depth + 2`` of them::

        0              Sequential([Unflatten to (1, s, s)], Conv3x3(C, channels), GroupNorm, ReLU)
        1 .. depth     BasicBlock(channels)
        depth + 1      Sequential(AdaptiveAvgPool2d(1), Flatten, Linear(channels, num_classes))
    """
    depth = check_int("resnet-gn", "depth", depth, 0)
    channels = check_int("resnet-gn", "channels", channels, 1)
    groups = check_int("resnet-gn", "groups", groups, 1)
    c, h, w = image_shape(input_shape)
    shape, _ = input_features(input_shape)
    reshape: list[nn.Module] = [] if len(shape) == 3 else [nn.Unflatten(1, (c, h, w))]
    stem = nn.Sequential(
        *reshape,
        nn.Conv2d(c, channels, 3, padding=1, bias=False),
        make_norm("resnet-gn", "group", channels, groups),
        nn.ReLU(),
    )
    units: list[nn.Module] = [stem]
    units += [BasicBlock(channels, groups) for _ in range(depth)]
    units.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)))
    return nn.Sequential(*units)
