"""Tests of `resnet-gn-skip`: shapes, layers, input forms, the long skip, errors, and its splits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models import ResNetGNSkip, build_model, find_batchnorm
from pipetrain.stages import split_model


def test_digits_shapes_and_layout():
    model = build_model("resnet-gn-skip", input_shape=(64,), num_classes=10, seed=0)
    assert isinstance(model, ResNetGNSkip) and not isinstance(model, nn.Sequential)
    names = [n for n, _ in model.named_children()]
    assert names == ["unflatten", "stem", "stem_norm", "layer1", "layer2", "pool", "head"]
    assert model(torch.rand(5, 64)).shape == (5, 10)
    assert sum(p.numel() for p in model.parameters()) == 43098
    assert not find_batchnorm(model)
    assert isinstance(model.layer2[0].shortcut, nn.Sequential)  # projection where the shape changes
    assert isinstance(model.layer1[0].shortcut, nn.Identity)
    assert model.head.in_features == 32 + 16  # pooled layer2 features next to the pooled stem


@pytest.mark.parametrize("shape", [(64,), (8, 8), (1, 8, 8), (3, 16, 16)])
def test_input_forms(shape):
    model = build_model("resnet-gn-skip:blocks=1/1/1,channels=8,groups=2", input_shape=shape, num_classes=4, seed=0)
    assert model(torch.rand(2, *shape)).shape == (2, 4)


def test_the_stem_skip_reaches_the_head():
    model = build_model("resnet-gn-skip:blocks=1,channels=8,groups=2", input_shape=(64,), num_classes=3, seed=0)
    x = torch.rand(2, 64)
    with torch.no_grad():
        for p in model.layer1.parameters():
            p.zero_()
    # with the residual layer silenced, the output still depends on the input through the skip
    assert not torch.allclose(model(x), model(torch.rand(2, 64)))


@pytest.mark.parametrize(
    "spec, word",
    [("resnet-gn-skip:blocks=0", "positive block counts"), ("resnet-gn-skip:blocks=1/1/1/1/1", "at most 4 layers"),
     ("resnet-gn-skip:channels=6,groups=4", "groups=4 must divide")],
)
def test_errors(spec, word):
    with pytest.raises(ConfigError, match=word):
        build_model(spec, input_shape=(64,), num_classes=10)


def test_automatic_split_points_are_blocks():
    model = build_model("resnet-gn-skip:blocks=2/2/2", input_shape=(64,), num_classes=10, seed=0)
    staged = split_model(model, stages=3)
    assert all(n.startswith("layer") for n in staged.split_at)
    counts = staged.parameter_counts()
    assert sum(counts) == sum(p.numel() for p in model.parameters())
