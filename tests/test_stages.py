"""Tests of pipetrain.stages: balances, splitting, boundaries, state-dict mapping, transparency."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models import build_model
from pipetrain.stages import (
    StagedModel,
    StageSequential,
    balance_by_params,
    balance_from_split_at,
    from_stages,
    partition_min_max,
    run_stages,
    split_model,
)


def model(spec: str = "mlp:depth=4,width=16") -> nn.Sequential:
    return build_model(spec, input_shape=(64,), num_classes=10, seed=0).double()


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters()}


@pytest.mark.parametrize(
    "spec, stages",
    [("mlp:depth=4,width=16", 1), ("mlp:depth=4,width=16", 3), ("mlp:depth=4,width=16", 5),
     ("resmlp:depth=6,width=16", 4), ("resmlp:depth=6,width=16,norm=layer", 8), ("resnet-gn:depth=3,channels=8", 2)],
)
def test_transparency_forward_and_backward(spec, stages):
    """Running the stages in sequence is running the model: same output, same gradients."""
    whole = model(spec)
    staged = split_model(whole, stages=stages)
    assert len(staged) == stages and sum(staged.balance) == len(whole)
    x = torch.rand(5, 64, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4])
    nn.functional.cross_entropy(whole(x), y).backward()
    expected = grads(whole)
    whole.zero_grad()
    out = run_stages(staged.stages, x)
    assert torch.equal(out, whole(x))
    nn.functional.cross_entropy(staged(x), y).backward()
    assert grads(whole).keys() == expected.keys()
    for key in expected:
        assert torch.equal(grads(whole)[key], expected[key]), key


def test_split_by_balance_keeps_names_and_shares_modules():
    whole = model()
    staged = split_model(whole, balance=[2, 2, 1])
    assert staged.balance == [2, 2, 1]
    assert [list(dict(s.named_children())) for s in staged.stages] == [["0", "1"], ["2", "3"], ["4"]]
    assert all(isinstance(s, StageSequential) for s in staged.stages)
    assert staged.stages[1][0] is whole[2]
    assert list(staged.stages[1].state_dict()) == ["2.0.weight", "2.0.bias", "3.0.weight", "3.0.bias"]
    assert staged.key_map[1] == {k: k for k in staged.stages[1].state_dict()}
    assert staged.parameter_counts() == [sum(p.numel() for p in s.parameters()) for s in staged.stages]


def test_merge_state_dict_loads_strict_and_saves(tmp_path):
    whole = model("resmlp:depth=5,width=16")
    staged = split_model(whole, stages=3)
    states = [{k: v.detach().clone() + 1 for k, v in s.state_dict().items()} for s in staged.stages]
    merged = staged.merge_state_dict(states)
    assert list(merged) == list(whole.state_dict())
    path = tmp_path / "model.pt"
    torch.save(merged, path)
    fresh = build_model("resmlp:depth=5,width=16", input_shape=(64,), num_classes=10, seed=1).double()
    fresh.load_state_dict(torch.load(path), strict=True)
    assert torch.equal(fresh[0].weight, whole[0].weight + 1)
    back = staged.split_state_dict(merged)
    for a, b in zip(back, states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_state_dict_errors():
    staged = split_model(model(), balance=[2, 3])
    states = [s.state_dict() for s in staged.stages]
    with pytest.raises(ConfigError, match="2 stages"):
        staged.merge_state_dict(states[:1])
    with pytest.raises(ConfigError, match="stage 1 does not match"):
        staged.merge_state_dict([states[0], {**states[1], "x": torch.zeros(1)}])
    with pytest.raises(ConfigError, match="different model"):
        staged.split_state_dict(states[0])


@pytest.mark.parametrize(
    "balance, words",
    [([2, 2], ["adds up to 4", "5 top-level modules", "must add up to 5"]),
     ([2, 0, 3], ["positive integer", "got 0"]),
     ([6, -1], ["positive integer", "got -1"]),
     ([], ["empty"])],
)
def test_bad_balance(balance, words):
    with pytest.raises(ConfigError) as info:
        split_model(model(), balance=balance)
    for word in words:
        assert word in str(info.value)


def test_more_stages_than_modules():
    with pytest.raises(ConfigError) as info:
        split_model(model(), stages=6)
    assert "5 top-level modules" in str(info.value) and "stages=5 or fewer" in str(info.value)


def test_non_sequential_is_traced():
    with pytest.raises(ConfigError) as info:
        split_model(nn.Linear(3, 3), stages=2)
    assert "stages=1 or fewer" in str(info.value)
    with pytest.raises(ConfigError, match=r"split_at \(the modules that start a stage\)"):
        split_model(nn.Linear(3, 3))


def test_stages_disagreeing_with_balance_and_no_instruction():
    with pytest.raises(ConfigError, match="disagrees"):
        split_model(model(), stages=3, balance=[2, 3])
    with pytest.raises(ConfigError, match=r"stages \(a stage count\)"):
        split_model(model())


def test_split_at_top_level_names():
    whole = model()
    assert balance_from_split_at(whole, ["2", "4"]) == [2, 2, 1]
    staged = split_model(whole, split_at=["3"])
    assert staged.balance == [3, 2]
    with pytest.raises(ConfigError, match="first module"):
        split_model(whole, split_at=["0"])
    nested = split_model(whole, split_at=["2.0"])  # inside a unit: traced, same cut here
    assert nested.split_at == ["2.0"] and nested.balance is None
    x = torch.rand(2, 64, dtype=torch.float64)
    assert torch.equal(nested(x), whole(x))
    with pytest.raises(ConfigError, match="did you mean '2'"):
        balance_from_split_at(whole, ["2 "])
    with pytest.raises(ConfigError, match="in model order"):
        split_model(whole, split_at=["3", "2"])


def test_list_of_modules_is_the_stages():
    stages = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
    staged = split_model(stages)
    assert staged.stages == stages and staged.balance is None
    assert staged.model_keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    merged = staged.merge_state_dict([s.state_dict() for s in stages])
    nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).load_state_dict(merged, strict=True)
    with pytest.raises(ConfigError, match="stages=3"):
        split_model(stages, stages=2)


class TwoPaths(nn.Module):
    """A non-Sequential model whose stages are its own submodules, passing a tuple across."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()

    def forward(self, x):
        return self.decoder(*self.encoder(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.register_buffer("count", torch.tensor(2.0))

    def forward(self, x):
        return self.a(x), self.b(x) * self.count


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(3, 2)

    def forward(self, u, v):
        return self.c(u * v)


def test_explicit_stages_of_a_model_with_tuple_boundary():
    whole = TwoPaths().double()
    staged = from_stages([whole.encoder, whole.decoder], whole)
    assert staged.key_map[0] == {"a.weight": "encoder.a.weight", "a.bias": "encoder.a.bias",
                                 "b.weight": "encoder.b.weight", "b.bias": "encoder.b.bias",
                                 "count": "encoder.count"}
    x = torch.rand(3, 4, dtype=torch.float64)
    assert torch.equal(staged(x), whole(x))
    merged = staged.merge_state_dict([s.state_dict() for s in staged.stages])
    TwoPaths().double().load_state_dict(merged, strict=True)
    with pytest.raises(ConfigError, match="leave out"):
        from_stages([whole.encoder], whole)
    with pytest.raises(ConfigError, match="not a parameter or buffer of the model"):
        from_stages([whole.encoder, nn.Linear(3, 2)], whole)


class Pair(nn.Module):
    def forward(self, x):
        return x, 2 * x


class Add(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def test_sequential_passing_tuples_is_cut_transparently():
    whole = nn.Sequential(nn.Linear(3, 3), Pair(), Add(), nn.Linear(3, 1))
    x = torch.rand(2, 3)
    for balance in ([2, 2], [1, 1, 1, 1], [2, 1, 1]):
        staged = split_model(whole, balance=balance)
        assert torch.equal(staged(x), whole(x)), balance


def test_tied_weights_are_aliases():
    first, last = nn.Linear(3, 3), nn.Linear(3, 3)
    last.weight = first.weight
    whole = nn.Sequential(first, nn.Tanh(), last)
    staged = split_model(whole, balance=[2, 1])
    assert staged.aliases == {"2.weight": "0.weight"}
    merged = staged.merge_state_dict([s.state_dict() for s in staged.stages])
    assert list(merged) == list(whole.state_dict())
    whole.load_state_dict(merged, strict=True)


def test_balance_by_params_examples():
    whole = build_model("mlp:depth=8,width=1024", input_shape=(64,), num_classes=10)
    assert balance_by_params(whole, 4) == [2, 2, 2, 3]
    assert balance_by_params(whole, 9) == [1] * 9
    deep = build_model("resmlp:depth=62,width=8", input_shape=(64,), num_classes=10)
    assert max(balance_by_params(deep, 64)) == 1
    assert balance_by_params(build_model("resmlp:depth=14", input_shape=(64,), num_classes=10), 4)[1:3] == [4, 4]
    assert partition_min_max([0] * 10, 3) == [3, 3, 4]
    assert partition_min_max([5, 5, 5, 5], 2) == [2, 2]
    with pytest.raises(ConfigError, match="positive integer"):
        balance_by_params(whole, 0)


def brute_force(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = largest if best is None else min(best, largest)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_partition_is_optimal(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    sizes = partition_min_max(weights, parts)
    assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == len(weights)
    bounds = list(itertools.accumulate([0, *sizes]))
    largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert largest == brute_force(weights, parts)


def test_staged_model_is_a_plain_record():
    staged = split_model(model(), stages=2)
    assert isinstance(staged, StagedModel) and len(staged.key_map) == 2
    assert sorted(k for m in staged.key_map for k in m.values()) == sorted(staged.model_keys)
