"""Tests of pipetrain.pb.reference: PB semantics, the two equivalent orders, and SGD at delay 0."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.models import build_model
from pipetrain.optim import SGD, build_stage_optimizers
from pipetrain.pb import pb_sequential, pb_ticks
from pipetrain.schedule import pb_delays
from pipetrain.stages import split_model

D = torch.float64


def _samples(n: int, features: int, classes: int, seed: int = 0, batch: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, features, generator=gen, dtype=D), torch.randint(0, classes, (batch,), generator=gen))
        for _ in range(n)
    ]


def _stages(spec: str, stages: int, features: int = 6, classes: int = 3):
    model = build_model(spec, input_shape=(features,), num_classes=classes, seed=0).double()
    return model, split_model(model, stages=stages)


def _equal(a, b) -> bool:
    return all(torch.equal(a.params[s][k], b.params[s][k]) for s in range(len(a.params)) for k in a.params[s])


@pytest.mark.parametrize("compensation", ["none", "sc", "lwp", "sc+lwp"])
@pytest.mark.parametrize("spec, stages", [("mlp:depth=3,width=8", 4), ("resmlp:depth=3,width=8,groups=2", 5)])
def test_tick_pipeline_equals_sample_sequential_bitwise(compensation, spec, stages):
    _, staged = _stages(spec, stages)
    samples = _samples(14, 6, 3)
    make = lambda: build_stage_optimizers(  # noqa: E731
        "sgd:lr=0.05,momentum=0.9,weight_decay=0.01", pb_delays(stages), compensation=compensation,
        lr_schedule="end:total=14,fraction=0.5",
    )
    sequential = pb_sequential(staged.stages, make(), samples)
    ticks = pb_ticks(staged.stages, make(), samples)
    assert _equal(sequential, ticks)
    assert sequential.losses == ticks.losses
    assert sequential.updates == ticks.updates == [14] * stages


def test_update_every_two_samples_agrees_between_orders():
    _, staged = _stages("mlp:depth=2,width=8", 3)
    samples = _samples(11, 6, 3, seed=1)
    make = lambda: build_stage_optimizers("sgd:lr=0.1,momentum=0.5", pb_delays(3))  # noqa: E731
    sequential = pb_sequential(staged.stages, make(), samples, update_every=2)
    ticks = pb_ticks(staged.stages, make(), samples, update_every=2)
    assert _equal(sequential, ticks)
    assert sequential.updates == [6, 6, 6]  # 5 full updates and the last sample alone


@pytest.mark.parametrize("spec", ["mlp:depth=3,width=8", "resmlp:depth=2,width=8,groups=2", "resnet-gn:depth=1,channels=4,groups=2"])
def test_zero_delays_are_batch_size_one_momentum_sgd_bitwise(spec):
    features = 16 if spec.startswith("resnet") else 6
    model, staged = _stages(spec, 3, features=features)
    samples = _samples(12, features, 3, seed=2)
    optimizers = build_stage_optimizers("sgd:lr=0.05,momentum=0.9", [0, 0, 0])
    result = pb_sequential(staged.stages, optimizers, samples, delays=[0, 0, 0])
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9, foreach=False)
    for x, y in samples:
        opt.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        opt.step()
    merged = staged.merge_state_dict(result.params)
    for key, value in plain.state_dict().items():
        assert torch.equal(merged[key], value), key


def test_delays_and_latest_weights_match_an_explicit_computation():
    """Three linear stages (no bias), plain momentum: the forward of sample n at stage s reads
    version max(0, n - D_s), the error passes through version n, and weight gradients use the
    forward's activations. Written out with explicit version lists."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5, bias=False), nn.Linear(5, 5, bias=False), nn.Linear(5, 3, bias=False)]
    stages = [layer.double() for layer in layers]
    samples = _samples(9, 4, 3, seed=3)
    lr, m = 0.2, 0.8
    optimizers = [SGD(lr=lr, momentum=m) for _ in stages]
    result = pb_sequential(stages, optimizers, samples)

    delays = pb_delays(3)  # 4, 2, 0
    versions = [[layer.weight.detach().clone()] for layer in stages]
    velocity = [torch.zeros_like(v[0]) for v in versions]
    for n, (x, y) in enumerate(samples):
        acts = [x]
        for s in range(3):
            acts.append(acts[-1] @ versions[s][max(0, n - delays[s])].T)
        g = torch.softmax(acts[3], -1)
        g[0, y] -= 1
        for s in (2, 1, 0):
            grad_w = g.T @ acts[s]
            g = g @ versions[s][n]  # the current weights, version n
            velocity[s] = velocity[s] * m + grad_w if n else grad_w
            versions[s].append(versions[s][n] - lr * velocity[s])
    for s in range(3):
        torch.testing.assert_close(result.params[s]["weight"], versions[s][-1], rtol=1e-12, atol=1e-12)
    stash = pb_sequential(stages, [SGD(lr=lr, momentum=m) for _ in stages], samples, policy="stash")
    assert not torch.allclose(stash.params[0]["weight"], result.params[0]["weight"])


def test_lwp_forward_reads_the_prediction_of_its_version():
    """One stage with delay 2 on a linear model: forward of n reads predict(w_v, v) with v = n - 2."""
    torch.manual_seed(1)
    layer = nn.Linear(3, 2, bias=False).double()
    samples = _samples(6, 3, 2, seed=4)
    lr, m, horizon = 0.3, 0.9, 2.0
    result = pb_sequential([layer], [SGD(lr=lr, momentum=m, lwp_horizon=horizon)], samples, delays=[2])
    versions, predicted = [layer.weight.detach().clone()], [layer.weight.detach().clone()]
    v = None
    for n, (x, y) in enumerate(samples):
        w_fwd = predicted[max(0, n - 2)]
        g = torch.softmax(x @ w_fwd.T, -1)
        g[0, y] -= 1
        grad = g.T @ x
        v = grad if v is None else v * m + grad
        versions.append(versions[-1] - lr * v)
        predicted.append(versions[-1] - lr * horizon * v)
    torch.testing.assert_close(result.params[0]["weight"], versions[-1], rtol=1e-12, atol=1e-12)


def test_input_is_not_modified_and_models_keep_their_weights():
    model, staged = _stages("mlp:depth=2,width=8", 3)
    before = copy.deepcopy(model.state_dict())
    pb_sequential(staged.stages, build_stage_optimizers("sgd:lr=0.1", pb_delays(3)), _samples(5, 6, 3))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_errors():
    _, staged = _stages("mlp:depth=2,width=8", 3)
    samples = _samples(3, 6, 3)
    opts = build_stage_optimizers("sgd:lr=0.1", pb_delays(3))
    with pytest.raises(ConfigError, match="optimizers for 3 stages"):
        pb_sequential(staged.stages, opts[:2], samples)
    with pytest.raises(ConfigError, match="must be 3 integers >= 0"):
        pb_sequential(staged.stages, opts, samples, delays=[0, 0])
    with pytest.raises(ConfigError, match="update_every"):
        pb_ticks(staged.stages, opts, samples, update_every=0)
    with pytest.raises(ConfigError, match="unknown PB weight policy"):
        pb_sequential(staged.stages, opts, samples, policy="flush")
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    with pytest.raises(PipetrainError, match="BatchNorm"):
        pb_sequential([bn, nn.Linear(4, 3)], build_stage_optimizers("sgd:lr=0.1", [2, 0]), samples)
