import pytest

from pipetrain.errors import ConfigError
from pipetrain.optim import parse_optimizer_spec, translate_hyperparameters


def test_reference_numbers():
    t = translate_hyperparameters(128, 0.1, 0.9, weight_decay=5e-4)
    assert f"{t.lr:.4g}" == "6.428e-06"
    assert f"{t.momentum:.6f}" == "0.999177"
    assert t.weight_decay == 5e-4 and t.batch_size == 1


def test_memory_in_samples_and_update_per_sample_are_kept():
    t = translate_hyperparameters(64, 0.05, 0.95, target_batch_size=8)
    assert t.momentum ** (64 / 8) == pytest.approx(0.95, rel=1e-14)
    assert t.lr / (8 * (1 - t.momentum)) == pytest.approx(0.05 / (64 * (1 - 0.95)), rel=1e-12)
    same = translate_hyperparameters(32, 0.1, 0.9, target_batch_size=32)
    assert same.lr == pytest.approx(0.1) and same.momentum == pytest.approx(0.9)


def test_no_momentum_divides_the_rate():
    t = translate_hyperparameters(16, 0.8, 0.0)
    assert t.momentum == 0.0 and t.lr == pytest.approx(0.05)


def test_spec_string_parses():
    spec = parse_optimizer_spec(translate_hyperparameters(128, 0.1, 0.9).spec())
    assert spec.options["momentum"] == pytest.approx(0.999177, abs=1e-6)


def test_errors():
    with pytest.raises(ConfigError, match="momentum=1.0 must lie in"):
        translate_hyperparameters(8, 0.1, 1.0)
    with pytest.raises(ConfigError, match="batch sizes must be >= 1"):
        translate_hyperparameters(0, 0.1, 0.9)
