import pytest
import torch

from pipetrain.errors import ConfigError
from pipetrain.optim import (
    SGD,
    Adam,
    AdamW,
    CosineLR,
    OptimizerSpec,
    build_stage_optimizer,
    build_stage_optimizers,
    parse_optimizer_spec,
)


def test_parse_sgd_and_round_trip():
    text = "sgd:lr=0.1,momentum=0.9,nesterov=true,weight_decay=1e-4,dampening=0"
    spec = parse_optimizer_spec(text)
    assert spec.name == "sgd"
    assert spec.options == dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4,
                                dampening=0.0)
    assert parse_optimizer_spec(str(spec)) == spec
    assert str(spec) == "sgd:lr=0.1,momentum=0.9,nesterov=true,weight_decay=0.0001,dampening=0.0"


def test_parse_adam():
    spec = parse_optimizer_spec(" Adam: lr=1e-3, betas=0.9/0.999, eps=1e-8, amsgrad=yes")
    assert spec.options == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, amsgrad=True)
    assert str(parse_optimizer_spec("adamw")) == "adamw"


@pytest.mark.parametrize(
    "text, message",
    [
        ("rmsprop:lr=1", "unknown optimizer 'rmsprop'.*valid names: adam, adamw, sgd"),
        ("sgd:lr=0.1,beta=2", "unknown option 'beta' for optimizer 'sgd'; valid options: "
                              "dampening, lr, momentum, nesterov, weight_decay"),
        ("adam:momentum=0.9", "valid options: amsgrad, betas, eps, lr, weight_decay"),
        ("sgd:lr=fast", "lr='fast' must be a number"),
        ("sgd:nesterov=maybe", "true or false"),
        ("adam:betas=0.9", "two numbers separated by '/'"),
        ("sgd:lr=0.1,lr=0.2", "given twice"),
        ("sgd:lr=nan", "finite"),
    ],
)
def test_parse_errors_teach(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_optimizer_spec(text)


def test_spec_object_checks_options():
    with pytest.raises(ConfigError, match="unknown option 'foo'"):
        OptimizerSpec("sgd", {"foo": 1})


def test_build_plain():
    optimizer = build_stage_optimizer("sgd:lr=0.1,momentum=0.9", stage_delay=6)
    assert isinstance(optimizer, SGD)
    assert (optimizer.lr, optimizer.momentum, optimizer.sc_delay, optimizer.lwp_horizon) == (
        0.1, 0.9, 0.0, 0.0)
    assert isinstance(build_stage_optimizer("adam"), Adam)
    assert isinstance(build_stage_optimizer("adamw:weight_decay=0.1"), AdamW)


def test_build_compensation_defaults_to_stage_delay():
    optimizer = build_stage_optimizer("sgd:lr=0.1,momentum=0.9", stage_delay=6,
                                      compensation="sc+lwp")
    assert optimizer.sc_delay == 6 and optimizer.lwp_horizon == 6
    optimizer = build_stage_optimizer("sgd:lr=0.1,momentum=0.9", stage_delay=6,
                                      compensation={"sc", "lwp"}, sc_delay=2, lwp_horizon=3.5)
    assert optimizer.sc_delay == 2 and optimizer.lwp_horizon == 3.5
    adam = build_stage_optimizer("adam", stage_delay=4, compensation="lwp")
    assert adam.lwp_horizon == 4


def test_build_with_schedule():
    optimizer = build_stage_optimizer("sgd:lr=0.1", lr_schedule="cosine:total=100")
    assert optimizer.lr_schedule == CosineLR(total=100)
    assert optimizer.lr_at(100) == pytest.approx(0.0, abs=1e-18)


def test_build_errors():
    with pytest.raises(ConfigError, match="spike compensation is defined for momentum SGD only"):
        build_stage_optimizer("adam", stage_delay=2, compensation="sc")
    with pytest.raises(ConfigError, match="sc_delay=3 is set but compensation 'sc' is off"):
        build_stage_optimizer("sgd", stage_delay=2, compensation="lwp", sc_delay=3)
    with pytest.raises(ConfigError, match="lwp_horizon=3 is set"):
        build_stage_optimizer("sgd", lwp_horizon=3)
    with pytest.raises(ConfigError, match="replaces Nesterov"):
        build_stage_optimizer("sgd:momentum=0.9,nesterov=true", stage_delay=1, compensation="sc")
    with pytest.raises(ConfigError, match="dlr_delay=4 is set but compensation 'dlr' is off"):
        build_stage_optimizer("sgd", stage_delay=2, compensation="sc", dlr_delay=4)


def test_build_dlr_per_stage():
    delays = [8, 6, 4, 2, 0]
    optimizers = build_stage_optimizers("sgd:lr=0.1,momentum=0.9", delays, compensation="sc+lwp+dlr4")
    assert [o.lr for o in optimizers] == [0.1 * 0.25, 0.1 * (4 / 6) ** 2, 0.1, 0.1, 0.1]
    assert [o.sc_delay for o in optimizers] == delays and [o.lwp_horizon for o in optimizers] == delays
    # dlr_delay overrides the name's D*; Adam's rate is scaled the same way
    assert build_stage_optimizers("sgd:lr=0.1", delays, compensation="dlr4", dlr_delay=2)[0].lr == 0.1 / 16
    assert build_stage_optimizer("adam:lr=0.01", stage_delay=8, compensation="lwp+dlr4").lr == 0.01 / 4


def test_build_one_per_stage_for_pb():
    stages = 5
    delays = [2 * (stages - 1 - s) for s in range(stages)]
    optimizers = build_stage_optimizers("sgd:lr=0.01,momentum=0.99", delays,
                                        compensation="sc", lr_schedule="constant:warmup=10")
    assert [o.sc_delay for o in optimizers] == [8, 6, 4, 2, 0]
    assert all(o.lr_schedule is optimizers[0].lr_schedule for o in optimizers)
    with pytest.raises(ConfigError, match="lwp_horizons has 2 entries but there are 5 stages"):
        build_stage_optimizers("sgd", delays, compensation="lwp", lwp_horizons=[1, 2])
    # the last stage (D = 0) with SC is exactly plain momentum
    last = optimizers[-1]
    plain = SGD(lr=0.01, momentum=0.99, lr_schedule=last.lr_schedule)
    w = {"w": torch.randn(3)}
    for step in range(3):
        g = {"w": torch.randn(3, generator=torch.Generator().manual_seed(step))}
        assert torch.equal(last.step(w, g, step)["w"], plain.step(w, g, step)["w"])
