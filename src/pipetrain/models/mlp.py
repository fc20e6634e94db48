"""`mlp`: hidden Linear+ReLU layers and a Linear head, one pipeline unit per layer."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from pipetrain.models.common import check_int, input_features

__all__ = ["mlp"]


def mlp(input_shape: Sequence[int] | int, num_classes: int, depth: int = 4, width: int = 128) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units, then a Linear head to ``num_classes``.

    Top-level children (the pipeline units), ``depth + 1`` of them::

        0 .. depth-1   Sequential(Linear, ReLU)      (unit 0 starts with Flatten for non-flat input)
        depth          Linear(width, num_classes)     the head, producing logits
    """
    depth = check_int("mlp", "depth", depth, 0)
    width = check_int("mlp", "width", width, 1)
    shape, features = input_features(input_shape)
    units: list[nn.Module] = []
    flatten: list[nn.Module] = [nn.Flatten()] if len(shape) != 1 else []
    for i in range(depth):
        first = flatten if i == 0 else []
        units.append(nn.Sequential(*first, nn.Linear(features if i == 0 else width, width), nn.ReLU()))
    head = nn.Linear(width if depth else features, num_classes)
    units.append(nn.Sequential(*flatten, head) if depth == 0 and flatten else head)
    return nn.Sequential(*units)
