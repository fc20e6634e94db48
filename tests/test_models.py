"""Tests of pipetrain.models: built-ins, the registry, user factories and BatchNorm detection."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from torch import nn

from pipetrain.data import dataset_info, get_batch, load_train_test
from pipetrain.errors import ConfigError
from pipetrain.models import MODELS, build_model, find_batchnorm, refuse_batchnorm

_counter = itertools.count()


def write_module(tmp_path, monkeypatch, source: str) -> str:
    name = f"pt_models_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


@pytest.mark.parametrize(
    "spec, units",
    [
        ("mlp", 5),
        ("mlp:depth=8,width=32", 9),
        ("mlp:depth=0", 1),
        ("resmlp", 18),
        ("resmlp:depth=62,width=16,norm=layer,act=relu", 64),
        ("resmlp:depth=2,norm=none,expansion=2", 4),
        ("resnet-gn", 6),
        ("resnet-gn:depth=2,channels=8,groups=2", 4),
        ("resnet-gn:widths=16/32/64,depth=3", 11),
        ("resnet-gn:widths=16/32/64,depth=3,units=conv", 20),
    ],
)
def test_builtins_shapes_and_units(spec, units):
    model = build_model(spec, input_shape=(64,), num_classes=10, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) == units
    assert model(torch.rand(3, 64)).shape == (3, 10)
    assert find_batchnorm(model) == []


def test_mlp_layout():
    model = build_model("mlp:depth=2,width=8", input_shape=(64,), num_classes=10)
    assert [type(m).__name__ for m in model[0]] == ["Linear", "ReLU"]
    assert (model[0][0].in_features, model[1][0].in_features, model[2].in_features) == (64, 8, 8)
    assert model[2].out_features == 10
    assert list(model.state_dict())[:2] == ["0.0.weight", "0.0.bias"]


def test_mlp_flattens_image_input():
    model = build_model("mlp:depth=1,width=4", input_shape=(1, 8, 8), num_classes=3)
    assert isinstance(model[0][0], nn.Flatten) and model(torch.rand(2, 1, 8, 8)).shape == (2, 3)
    model = build_model("mlp:depth=0", input_shape=(2, 3), num_classes=3)
    assert model(torch.rand(2, 2, 3)).shape == (2, 3)


def test_resnet_takes_images_and_rejects_non_square():
    model = build_model("resnet-gn:depth=1,channels=4,groups=2", input_shape=(3, 6, 6), num_classes=2)
    assert model(torch.rand(2, 3, 6, 6)).shape == (2, 2)
    with pytest.raises(ConfigError, match="flat square"):
        build_model("resnet-gn", input_shape=(63,), num_classes=2)


def test_resnet_cut_by_convolution_is_the_same_network():
    # units=conv splits every block into two units (one convolution each), same weights per seed
    spec = "resnet-gn:widths=4/8,depth=2,groups=2"
    blocks = build_model(spec, input_shape=(64,), num_classes=10, seed=3)
    convs = build_model(spec + ",units=conv", input_shape=(64,), num_classes=10, seed=3)
    assert [type(u).__name__ for u in convs[1:5]] == ["BlockHead", "BlockTail", "BlockHead", "BlockTail"]
    assert list(blocks.state_dict().keys()) != list(convs.state_dict().keys())
    for a, b in zip(blocks.state_dict().values(), convs.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.rand(3, 64)
    torch.testing.assert_close(blocks(x), convs(x), rtol=0, atol=0)
    assert blocks[3].conv1.stride == (2, 2) and blocks(x).shape == (3, 10)
    assert sum(isinstance(m, nn.Conv2d) for m in convs.modules()) == 9  # stem + 2 per block


def test_resnet_zero_init_starts_blocks_as_their_shortcut():
    spec = "resnet-gn:widths=4/8,depth=1,groups=2,zero_init=true"
    model = build_model(spec, input_shape=(64,), num_classes=10, seed=0)
    assert all(not b.norm2.weight.detach().any() for b in model[1:3])
    x = torch.rand(2, 1, 8, 8)
    stem = model[0][1:](x)
    torch.testing.assert_close(model[1](stem), stem)  # relu(stem + 0) with stem >= 0


def test_seeded_init_is_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    a = build_model("resmlp:depth=3", input_shape=(64,), num_classes=10, seed=7)
    assert torch.equal(torch.rand(2), expected)
    b = build_model("resmlp:depth=3", input_shape=(64,), num_classes=10, seed=7)
    c = build_model("resmlp:depth=3", input_shape=(64,), num_classes=10, seed=8)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert not torch.equal(a[0].weight, c[0].weight)
    torch.manual_seed(5)
    d = build_model("mlp", input_shape=(64,), num_classes=10)
    torch.manual_seed(5)
    e = build_model("mlp", input_shape=(64,), num_classes=10)
    assert torch.equal(d[0][0].weight, e[0][0].weight)


@pytest.mark.parametrize(
    "spec", ["mlp", "resmlp:depth=3", "resmlp:depth=3,norm=layer", "resnet-gn:depth=2",
             "resnet-gn:widths=4/8,depth=1,units=conv", "resnet-gn-skip:blocks=1/1"]
)
def test_per_sample_arithmetic(spec):
    """No statistics across samples: a batch gives the rows its samples give alone."""
    model = build_model(spec, input_shape=(64,), num_classes=10, seed=0)
    x = torch.rand(4, 64, dtype=torch.float64)
    model = model.double()
    batch = model(x)
    for i in range(4):
        torch.testing.assert_close(model(x[i : i + 1])[0], batch[i])


@pytest.mark.parametrize(
    "spec, word",
    [
        ("mlp:depth=-1", "depth must be an integer >= 0"),
        ("mlp:width=2.5", "width"),
        ("mlp:widht=3", "accepted: depth, width. Did you mean 'width'"),
        ("resmlp:norm=batch", "norm must be one of group, layer, none"),
        ("resmlp:width=12,groups=8", "groups=8 must divide"),
        ("resmlp:act=tanh", "act"),
        ("resnet-gn:channels=6", "groups=4 must divide"),
        ("resnet-gn:widths=16/32,channels=16", "not both"),
        ("resnet-gn:widths=32/16", "must not shrink"),
        ("resnet-gn:widths=4/8/16/32/64", "at most 4 widths"),
        ("resnet-gn:units=layer", "units must be one of block, conv"),
        ("mpl", "Did you mean 'mlp'"),
    ],
)
def test_option_errors(spec, word):
    with pytest.raises(ConfigError) as info:
        build_model(spec, input_shape=(64,), num_classes=10)
    assert word in str(info.value)


def test_registry_names():
    assert set(MODELS) == {"mlp", "resmlp", "resnet-gn", "resnet-gn-skip", "gpt"}


FACTORY = """
import torch
from torch import nn

def sized(in_features, num_classes, hidden=5):
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))

def shaped(input_shape, **options):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * input_shape[1], options["num_classes"]))

def stage_list(width=4):
    return [nn.Linear(64, width), nn.Linear(width, 10)]

def fixed():
    return nn.Linear(64, 10)

def wrong():
    return "a model"
"""


def test_user_factories(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    model = build_model(f"{name}:sized:hidden=7", input_shape=(64,), num_classes=10)
    assert model[0].weight.shape == (7, 64) and model[2].out_features == 10
    model = build_model(f"{name}:shaped", input_shape=(2, 3), num_classes=4)
    assert model(torch.rand(5, 2, 3)).shape == (5, 4)
    model = build_model(f"{name}:stage_list:width=3", input_shape=(64,), num_classes=10)
    assert isinstance(model, nn.Sequential) and len(model) == 2
    assert isinstance(build_model(f"{name}:fixed", input_shape=64, num_classes=10), nn.Linear)
    with pytest.raises(ConfigError, match="must return an nn.Module"):
        build_model(f"{name}:wrong", input_shape=(64,), num_classes=10)
    with pytest.raises(ConfigError, match="accepted: width"):
        build_model(f"{name}:stage_list:depth=3", input_shape=(64,), num_classes=10)


def test_find_and_refuse_batchnorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()), nn.GroupNorm(2, 4))
    model.add_module("extra", nn.BatchNorm2d(3))
    assert find_batchnorm(model) == ["1.0", "extra"]
    with pytest.raises(ConfigError) as info:
        refuse_batchnorm(model)
    message = str(info.value)
    assert "'1.0', 'extra'" in message and "GroupNorm or LayerNorm" in message and "batch size 1" in message
    model[1][0].eval()
    assert find_batchnorm(model, training_only=True) == ["extra"]
    model.eval()
    refuse_batchnorm(model)
    assert find_batchnorm(nn.BatchNorm1d(2)) == [""]


def test_mlp_learns_digits():
    torch.set_num_threads(1)
    train, test = load_train_test("digits")
    info = dataset_info(train)
    model = build_model("mlp:depth=2,width=64", input_shape=info.input_shape, num_classes=info.num_classes, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        for index in torch.randperm(len(train), generator=generator).split(32):
            x, y = get_batch(train, index)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(test.features).argmax(1) == test.labels).float().mean().item()
    assert accuracy > 0.93
