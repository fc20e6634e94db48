"""Tests of pipetrain.pb.engine: the batched tick engine equals the reference PB (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipetrain.errors import PipetrainError
from pipetrain.models import build_model
from pipetrain.optim import Adam, build_stage_optimizers
from pipetrain.pb import pb_sequential
from pipetrain.pb.engine import BatchedPB
from pipetrain.pb.groups import NotBatchable, stage_units
from pipetrain.schedule import pb_delays
from pipetrain.stages import split_model

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-11)


def _data(n: int, features: int, classes: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=gen, dtype=D), torch.randint(0, classes, (n,), generator=gen)


def _optimizers(stages: int, compensation: str, spec: str = "sgd:lr=0.03,momentum=0.9,weight_decay=0.01", total: int = 16):
    return build_stage_optimizers(spec, pb_delays(stages), compensation=compensation,
                                  lr_schedule=f"end:total={total},fraction=0.5")


def _compare(spec: str, stages: int, compensation: str, *, features: int = 6, n: int = 16, opt_spec=None, balance=None):
    model = build_model(spec, input_shape=(features,), num_classes=3, seed=0).double()
    x, y = _data(n, features, 3)
    ref_model, fast_model = copy.deepcopy(model), copy.deepcopy(model)
    cut = dict(balance=balance) if balance else dict(stages=stages)
    ref_staged, fast_staged = split_model(ref_model, **cut), split_model(fast_model, **cut)
    kwargs = {} if opt_spec is None else {"spec": opt_spec}
    reference = pb_sequential(ref_staged.stages, _optimizers(stages, compensation, **kwargs, total=n),
                              [(x[i : i + 1], y[i : i + 1]) for i in range(n)])
    engine = BatchedPB([fast_staged.stages], [_optimizers(stages, compensation, **kwargs, total=n)],
                       sample_shape=(features,), dtype=D)
    losses = engine.train(x, y, torch.arange(n).view(n, 1))
    engine.write_back()
    want = ref_staged.merge_state_dict(reference.params)
    for key, value in fast_model.state_dict().items():
        torch.testing.assert_close(value, want[key], **TOL, msg=key)
    torch.testing.assert_close(losses[:, 0], torch.tensor(reference.losses, dtype=D), **TOL)
    return engine


@pytest.mark.parametrize("compensation", ["none", "sc", "lwp", "sc+lwp", "sc+lwp+dlr1", "sc+lwp+dts1", "sc+lwp+dtsf1",
                                          "sc+lwp+dtt1"])
def test_residual_mlp_with_several_units_per_stage(compensation):
    # 6 units in 3 stages of 2: blocks of different stages (different delays) share a group
    engine = _compare("resmlp:depth=4,width=8,groups=2", 3, compensation, balance=[2, 2, 2])
    assert any(g["members"] > 1 for g in engine.describe())


@pytest.mark.parametrize("compensation", ["none", "sc+lwp"])
def test_one_unit_per_stage_and_layer_norm(compensation):
    _compare("resmlp:depth=4,width=8,norm=layer,act=relu", 6, compensation)


def test_residual_cnn():
    _compare("resnet-gn:depth=2,channels=4,groups=2", 4, "sc", features=16)


@pytest.mark.parametrize("compensation, opt_spec", [("none", None), ("sc+lwp+dlr2", None),
                                                    ("sc", "sgd:lr=0.03,momentum=0.9")])
def test_residual_cnn_cut_by_convolution(compensation, opt_spec):
    # every convolution a stage: the shortcut travels as channels, widening blocks stride and pad;
    # without weight decay SC adds the convolutions' unmultiplied weight gradients to the weights
    engine = _compare("resnet-gn:widths=2/4,depth=1,groups=2,units=conv,zero_init=true", 6, compensation,
                      features=16, opt_spec=opt_spec)
    assert "generic" not in [g["kind"] for g in engine.describe()]


def test_nesterov_and_plain_sgd_without_momentum():
    _compare("mlp:depth=3,width=8", 4, "none", opt_spec="sgd:lr=0.05,momentum=0.9,nesterov=true")
    _compare("mlp:depth=3,width=8", 4, "lwp", opt_spec="sgd:lr=0.05")


class Swish(nn.Module):
    """Not covered by the kernels: runs through autograd with the latest hooks."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.lin(x))


def test_generic_units_fall_back_to_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Swish(8), Swish(8), nn.Sequential(nn.ELU(), nn.Linear(8, 3))).double()
    x, y = _data(12, 6, 3)
    ref_model, fast_model = copy.deepcopy(model), copy.deepcopy(model)
    ref_staged, fast_staged = split_model(ref_model, stages=4), split_model(fast_model, stages=4)
    reference = pb_sequential(ref_staged.stages, _optimizers(4, "sc+lwp", total=12),
                              [(x[i : i + 1], y[i : i + 1]) for i in range(12)])
    engine = BatchedPB([fast_staged.stages], [_optimizers(4, "sc+lwp", total=12)], sample_shape=(6,), dtype=D)
    engine.train(x, y, torch.arange(12).view(12, 1))
    engine.write_back()
    assert [g["kind"] for g in engine.describe()].count("generic") == 3
    want = ref_staged.merge_state_dict(reference.params)
    for key, value in fast_model.state_dict().items():
        torch.testing.assert_close(value, want[key], **TOL, msg=key)


def test_runs_in_one_engine_train_independently():
    # two runs with different seeds, data orders and compensation in one engine
    x, y = _data(20, 6, 3)
    models = [build_model("resmlp:depth=2,width=8,groups=2", input_shape=(6,), num_classes=3, seed=s).double()
              for s in range(2)]
    orders = torch.stack([torch.randperm(20, generator=torch.Generator().manual_seed(s)) for s in range(2)], 1)
    comps = ["sc", "lwp"]
    together = [copy.deepcopy(m) for m in models]
    engine = BatchedPB([split_model(m, stages=4).stages for m in together],
                       [_optimizers(4, c, total=20) for c in comps], sample_shape=(6,), dtype=D)
    losses = engine.train(x, y, orders)
    engine.write_back()
    for r, model in enumerate(models):
        alone = copy.deepcopy(model)
        single = BatchedPB([split_model(alone, stages=4).stages], [_optimizers(4, comps[r], total=20)],
                           sample_shape=(6,), dtype=D)
        single_losses = single.train(x, y, orders[:, r : r + 1])
        single.write_back()
        torch.testing.assert_close(losses[:, r], single_losses[:, 0], **TOL)
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(together[r].state_dict()[key], value, **TOL, msg=key)


def test_one_stage_with_batches_is_minibatch_sgd():
    model = build_model("resmlp:depth=2,width=8,groups=2", input_shape=(6,), num_classes=3, seed=0).double()
    x, y = _data(24, 6, 3)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1)).view(6, 1, 4)
    plain = copy.deepcopy(model)
    fast = copy.deepcopy(model)
    engine = BatchedPB([split_model(fast, stages=1).stages],
                       [build_stage_optimizers("sgd:lr=0.1,momentum=0.9", [0])], sample_shape=(6,),
                       batch_size=4, dtype=D)
    losses = engine.train(x, y, order)
    engine.write_back()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for t in range(6):
        idx = order[t, 0]
        loss = nn.functional.cross_entropy(plain(x[idx]), y[idx])
        torch.testing.assert_close(losses[t, 0], loss.detach(), **TOL)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[key], value, **TOL, msg=key)


def test_what_the_engine_does_not_run():
    model = build_model("mlp:depth=2,width=8", input_shape=(6,), num_classes=3, seed=0)
    stages = split_model(model, stages=3).stages
    adam = [Adam(lr=1e-3) for _ in range(3)]
    with pytest.raises(NotBatchable, match="momentum SGD only"):
        BatchedPB([stages], [adam], sample_shape=(6,))
    damped = build_stage_optimizers("sgd:lr=0.1,momentum=0.9,dampening=0.5", pb_delays(3))
    with pytest.raises(NotBatchable, match="dampening"):
        BatchedPB([stages], [damped], sample_shape=(6,))
    bn = [nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), nn.Linear(4, 3)]
    with pytest.raises(PipetrainError, match="BatchNorm"):
        BatchedPB([bn], [build_stage_optimizers("sgd:lr=0.1", [2, 0])], sample_shape=(6,))


def test_stage_units():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert stage_units(seq) == list(seq.children())
    lin = nn.Linear(2, 2)
    assert stage_units(lin) == [lin]
