import math

import pytest

from pipetrain.errors import ConfigError
from pipetrain.optim import ConstantLR, CosineLR, EndDecayLR, StepLR, parse_lr_schedule


def test_constant_and_warmup():
    assert ConstantLR().lr_at(10**9, 0.1) == 0.1
    warm = ConstantLR(warmup=100)
    assert [warm.factor(s) for s in (0, 25, 50, 100, 1000)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    started = ConstantLR(warmup=10, warmup_start=0.5)
    assert started.factor(0) == 0.5 and started.factor(5) == 0.75 and started.factor(10) == 1.0


def test_step_decay_at_sample_milestones():
    schedule = StepLR(milestones=(100, 300), gamma=0.1)
    assert [schedule.factor(s) for s in (0, 99, 100, 299)] == [1.0, 1.0, 0.1, 0.1]
    assert schedule.factor(300) == pytest.approx(0.01)


def test_cosine_after_warmup():
    schedule = CosineLR(total=1100, warmup=100, final=0.1)
    assert schedule.factor(50) == 0.5
    assert schedule.factor(100) == 1.0
    assert schedule.factor(600) == pytest.approx(0.55)
    assert schedule.factor(1100) == pytest.approx(0.1)
    assert schedule.factor(5000) == schedule.factor(1100)
    assert CosineLR(total=4).factor(1) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_decay_at_the_end():
    linear = EndDecayLR(total=1000, fraction=0.2)
    assert [linear.factor(s) for s in (0, 799, 800, 900, 1000, 2000)] == pytest.approx(
        [1.0, 1.0, 1.0, 0.5, 0.0, 0.0]
    )
    step = EndDecayLR(total=1000, fraction=0.25, shape="step")
    assert [step.factor(s) for s in (749, 750, 999)] == [1.0, 0.1, 0.1]
    assert EndDecayLR(total=10, shape="linear", final=0.5).factor(10) == 0.5


def test_parse():
    assert parse_lr_schedule("constant") == ConstantLR()
    assert parse_lr_schedule("constant:warmup=1e3") == ConstantLR(warmup=1000)
    assert parse_lr_schedule("step:milestones=30000/60_000,gamma=0.2") == StepLR(
        milestones=(30000, 60000), gamma=0.2
    )
    assert parse_lr_schedule("cosine:total=1e5,final=0,warmup=1000") == CosineLR(
        total=100000, warmup=1000
    )
    assert parse_lr_schedule("end:total=500,fraction=0.1,shape=step") == EndDecayLR(
        total=500, fraction=0.1, shape="step"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("linear", "unknown lr schedule 'linear'.*valid names: constant, cosine, end, step"),
        ("cosine:total=10,gamma=2", "unknown option 'gamma'.*valid options: final, total, warmup"),
        ("cosine", "needs total="),
        ("cosine:total=10,warmup=10", "total=10 > warmup=10"),
        ("step:milestones=5/3", "increasing"),
        ("constant:warmup=1.5", "whole number"),
        ("end:total=10,shape=cosine", "'linear' or 'step'"),
        ("constant:warmup", "key=value"),
    ],
)
def test_parse_errors_teach(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_lr_schedule(text)


def test_negative_samples_are_refused():
    with pytest.raises(ConfigError, match="samples_seen"):
        ConstantLR().factor(-1)
