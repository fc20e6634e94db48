"""`resmlp`: a pre-norm residual MLP whose blocks are the pipeline units (no BatchNorm)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipetrain.models.common import check_choice, check_int, input_features, make_norm

__all__ = ["ResidualBlock", "resmlp"]

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class ResidualBlock(nn.Module):
    """``x + fc2(act(fc1(norm(x))))``: one residual unit of per-sample arithmetic only.

    GroupNorm and LayerNorm normalise each sample on its own, so the block computes the same at
    batch size 1 as at any other batch size, as Pipelined Backpropagation requires.
    """

    def __init__(self, norm: nn.Module, width: int, hidden: int, act: type[nn.Module]):
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(width, hidden)
        self.act = act()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def resmlp(
    input_shape: Sequence[int] | int,
    num_classes: int,
    depth: int = 16,
    width: int = 64,
    norm: str | None = "group",
    groups: int = 8,
    act: str = "gelu",
    expansion: int = 1,
) -> nn.Sequential:
    """Input projection, ``depth`` :class:`ResidualBlock` s, normalised Linear head.

    Top-level children (the pipeline units), ``depth + 2`` of them::

        0              Linear(in_features, width)            (after Flatten for non-flat input)
        1 .. depth     ResidualBlock(norm, width, expansion*width, act)
        depth + 1      Sequential(norm, Linear(width, num_classes))

    ``norm`` is ``group`` (GroupNorm with ``groups`` groups), ``layer`` or ``none``.
    """
    depth = check_int("resmlp", "depth", depth, 0)
    width = check_int("resmlp", "width", width, 1)
    groups = check_int("resmlp", "groups", groups, 1)
    expansion = check_int("resmlp", "expansion", expansion, 1)
    norm = check_choice("resmlp", "norm", "none" if norm is None else norm, ("group", "layer", "none"))
    act_type = _ACTIVATIONS[check_choice("resmlp", "act", act, tuple(_ACTIVATIONS))]
    shape, features = input_features(input_shape)
    stem = nn.Linear(features, width)
    units: list[nn.Module] = [nn.Sequential(nn.Flatten(), stem) if len(shape) != 1 else stem]
    for _ in range(depth):
        units.append(ResidualBlock(make_norm("resmlp", norm, width, groups), width, expansion * width, act_type))
    units.append(nn.Sequential(make_norm("resmlp", norm, width, groups), nn.Linear(width, num_classes)))
    return nn.Sequential(*units)
