"""`resnet-gn-skip`: a GroupNorm ResNet written as an ordinary nn.Module, with a long skip.

Unlike `resnet-gn` (an ``nn.Sequential`` of pipeline units), this is a model as people write
them: ``forward`` wires the parts by hand, the blocks have projection shortcuts where the shape
changes, and the stem's features skip past every layer to the head::

    s = relu(gn(conv(x)))                    stem            (C, 8, 8)
    y = layer1(s); y = layer2(y); ...        residual layers (C, 2C, 4C, ...), stride 2 from layer2
    logits = head(cat(pool(y), pool(s)))     the long skip:  s is used at the very end

Cut with torch.fx (``split_model(model, stages=S)`` or ``split_at=["layer1.1", "layer2.0.conv2"]``),
``s`` crosses every stage boundary, and a cut inside a block (``layer2.0.conv2``) makes the
block's shortcut cross one: the stages hand these values on unchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models.common import check_int, input_features, make_norm
from pipetrain.models.resnet import image_shape

__all__ = ["ResNetGNSkip", "SkipBlock", "resnet_gn_skip"]


class SkipBlock(nn.Module):
    """``relu(shortcut(x) + gn(conv(relu(gn(conv(x))))))``; the shortcut projects when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm("resnet-gn-skip", "group", cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = make_norm("resnet-gn-skip", "group", cout, groups)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), make_norm("resnet-gn-skip", "group", cout, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(self.shortcut(x) + y)


class ResNetGNSkip(nn.Module):
    """Stem, residual layers ``layer1..layerL`` (``nn.Sequential`` of :class:`SkipBlock`), head."""

    def __init__(
        self,
        image: tuple[int, int, int],
        num_classes: int,
        blocks: Sequence[int] = (2, 2),
        channels: int = 16,
        groups: int = 4,
        input_dims: int = 1,
    ):
        super().__init__()
        c, h, w = image
        self.unflatten: nn.Module = nn.Identity()
        if input_dims == 1:
            self.unflatten = nn.Unflatten(1, image)
        elif input_dims == 2:
            self.unflatten = nn.Unflatten(1, (1, h))
        self.stem = nn.Conv2d(c, channels, 3, padding=1, bias=False)
        self.stem_norm = make_norm("resnet-gn-skip", "group", channels, groups)
        width = channels
        for i, count in enumerate(blocks):
            out = channels * 2**i
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(*(SkipBlock(width if j == 0 else out, out, stride if j == 0 else 1, groups)
                                    for j in range(count)))
            self.add_module(f"layer{i + 1}", layer)
            width = out
        self.num_layers = len(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width + channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.stem_norm(self.stem(self.unflatten(x))))
        y = s
        for i in range(self.num_layers):
            y = getattr(self, f"layer{i + 1}")(y)
        features = torch.cat([self.pool(y).flatten(1), self.pool(s).flatten(1)], dim=1)
        return self.head(features)


def resnet_gn_skip(
    input_shape: Sequence[int] | int,
    num_classes: int,
    blocks: Sequence[int] | int = (2, 2),
    channels: int = 16,
    groups: int = 4,
) -> ResNetGNSkip:
    """A :class:`ResNetGNSkip` for images ``(C, H, W)``, ``(H, W)`` or flat squares (digits: 8x8).

    ``blocks`` gives the blocks of each layer (``blocks=2/2/2`` in a spec); layer ``i`` has
    ``channels * 2**i`` channels and halves the resolution from the second layer on.
    """
    counts = [blocks] if isinstance(blocks, int) else list(blocks)
    if not counts or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in counts):
        raise ConfigError(
            f"model resnet-gn-skip: blocks must be positive block counts per layer, e.g. blocks=2/2, "
            f"got {blocks!r}"
        )
    channels = check_int("resnet-gn-skip", "channels", channels, 1)
    groups = check_int("resnet-gn-skip", "groups", groups, 1)
    image = image_shape(input_shape)
    shape, _ = input_features(input_shape)
    if min(image[1:]) < 2 ** (len(counts) - 1):
        raise ConfigError(
            f"model resnet-gn-skip: {len(counts)} layers halve {image[1]}x{image[2]} images "
            f"{len(counts) - 1} times; use at most {min(image[1:]).bit_length()} layers"
        )
    return ResNetGNSkip(image, num_classes, counts, channels, groups, input_dims=len(shape))
