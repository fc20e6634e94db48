"""Profiling real modules: sizes exactly, times attributed to the right layer."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profiler import profile_model

torch.set_num_threads(1)


def batch(n=8, features=16, classes=4):
    return torch.randn(n, features), torch.randint(0, classes, (n,))


def test_sequential_sizes_and_chain():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
    profile = profile_model(model, batch(), iterations=2, warmup=1, progress=False,
                            optimizer_states=2.0)
    names = [layer.name for layer in profile.layers]
    assert names == ["input", "0", "1", "2"] and profile.layers[0].input
    assert profile.edge_list() == [("input", "0"), ("0", "1"), ("1", "2")]
    first, relu, last = profile.layers[1:]
    assert first.parameter_bytes == (16 * 32 + 32) * 4
    assert first.optimizer_bytes == 2 * first.parameter_bytes
    assert first.activation_bytes == 8 * 32 * 4 and last.activation_bytes == 8 * 4 * 4
    assert relu.parameter_bytes == 0
    assert all(l.forward_s > 0 and l.backward_s > 0 for l in profile.layers[1:])
    assert profile.batch_size == 8
    assert model[1].inplace     # restored after profiling


class Clock:
    """Seconds that pass only where a test says (``advance``): the profile's times are then exact."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(0.03)
        return grad, None


class Slow(nn.Module):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, x):
        self.clock.advance(0.015)
        return _SlowBackward.apply(x, self.clock)


def test_times_land_on_the_right_layer():
    clock = Clock()
    model = nn.Sequential(nn.Linear(16, 16), Slow(clock), nn.Linear(16, 4))
    profile = profile_model(model, batch(), iterations=2, warmup=1, progress=False, clock=clock)
    slow = profile.layers[2]
    assert slow.forward_s == pytest.approx(0.015) and slow.backward_s == pytest.approx(0.03)
    others = [profile.layers[1], profile.layers[3]]
    assert all(l.forward_s < slow.forward_s and l.backward_s < slow.backward_s for l in others)


class OnceSlow(nn.Module):
    """Takes 10 ms per forward, 60 ms on one call only (an interruption by another process)."""

    def __init__(self, slow_call, clock: Clock):
        super().__init__()
        self.calls, self.slow_call, self.clock = 0, slow_call, clock

    def forward(self, x):
        self.calls += 1
        self.clock.advance(0.06 if self.calls == self.slow_call else 0.01)
        return x.clone()


def test_median_ignores_one_interrupted_iteration_mean_does_not():
    # warm-up 1, then 3 measured iterations; the second measured one is slow
    profiles = []
    for statistic in ("median", "mean"):
        clock = Clock()
        profiles.append(profile_model(nn.Sequential(nn.Linear(16, 16), OnceSlow(3, clock)), batch(), iterations=3,
                                      warmup=1, progress=False, statistic=statistic, clock=clock))
    median, mean = profiles
    assert median.layers[2].forward_s == pytest.approx(0.01)
    assert mean.layers[2].forward_s == pytest.approx((0.01 + 0.06 + 0.01) / 3)
    assert median.meta["statistic"] == "median" and mean.meta["statistic"] == "mean"


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.b(torch.relu(self.a(h)))
        return self.head(h)


def test_fx_graph_keeps_skip_connections():
    profile = profile_model(Residual(), batch(), iterations=2, warmup=1, progress=False)
    names = [layer.name for layer in profile.layers]
    assert names[0] == "x" and profile.layers[0].input
    assert {"stem", "a", "relu", "b", "add", "head"} <= set(names)
    assert ("stem", "add") in profile.edges and ("b", "add") in profile.edges
    assert sum(l.parameter_bytes for l in profile.layers) == \
        sum(p.numel() * 4 for p in Residual().parameters())
    plan = optimize(profile, 2)
    where = plan.layer_to_stage()
    assert all(where[a] <= where[b] for a, b in profile.edges)


def test_untraceable_model_is_a_clear_error():
    class Dynamic(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.lin(x)
            return self.lin(-x)

    with pytest.raises(ConfigError, match="cannot trace Dynamic with torch.fx"):
        profile_model(Dynamic(), batch(), iterations=1, warmup=0, progress=False)


def test_bad_arguments():
    with pytest.raises(ConfigError):
        profile_model(nn.Sequential(nn.Linear(16, 4)), batch(), iterations=0, progress=False)
    with pytest.raises(ConfigError, match="unknown statistic 'max'; choose median or mean"):
        profile_model(nn.Sequential(nn.Linear(16, 4)), batch(), statistic="max", progress=False)


def test_a_meta_model_is_profiled_unit_by_unit_and_stays_on_meta():
    from pipetrain.models.gpt import GPT
    from pipetrain.plan.profiler import profile_by_unit
    from pipetrain.initialiser import resolve_init
    from pipetrain.stages.materialize import has_meta

    with torch.device("meta"):
        model = GPT(20, 8, n_layer=2, n_head=2, n_embd=16)
    ids = torch.randint(0, 20, (4, 8))
    clock = Clock()
    profile = profile_by_unit(model, (ids, ids), lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                              init=resolve_init("reset"), iterations=2, warmup=1, clock=clock)
    assert [layer.name for layer in profile.layers] == ["input", "wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f",
                                                          "head"]
    assert [layer.kind for layer in profile.layers][1:5] == ["Embedding", "Embedding", "Dropout", "Block"]
    blocks = profile.layers[4]
    assert blocks.parameter_bytes == 4 * sum(p.numel() for p in model.blocks[0].parameters())
    assert blocks.activation_bytes == 4 * 4 * 8 * 16  # the hidden states it hands on
    assert has_meta(model)  # every unit was freed again
