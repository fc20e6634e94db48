"""Checks and shape helpers shared by the built-in model builders."""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn

from pipetrain.errors import ConfigError

__all__ = ["check_int", "check_choice", "input_features", "make_norm"]


def check_int(model: str, key: str, value: object, low: int) -> int:
    """``value`` as an int >= ``low``, or a ConfigError naming the model option."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"model {model}: {key} must be an integer >= {low}, got {value!r}")
    return value


def check_choice(model: str, key: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(f"model {model}: {key} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def input_features(input_shape: Sequence[int] | int) -> tuple[tuple[int, ...], int]:
    """``(shape, flattened size)`` of one input sample; an int means a flat vector."""
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"input shape {shape} is not a valid sample shape")
    return shape, math.prod(shape)


def make_norm(model: str, kind: str, width: int, groups: int) -> nn.Module:
    """A per-sample normalisation of ``width`` features: GroupNorm, LayerNorm or none."""
    if kind == "group":
        if width % groups:
            raise ConfigError(
                f"model {model}: groups={groups} must divide width/channels={width} for GroupNorm"
            )
        return nn.GroupNorm(groups, width)
    if kind == "layer":
        return nn.LayerNorm(width)
    return nn.Identity()
