import io

import pytest
import torch

from optim_helpers import compare_with_torch
from pipetrain.errors import ConfigError
from pipetrain.optim import Adam, AdamW

SETTINGS = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=1e-2, weight_decay=1e-2),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=3e-3, weight_decay=1e-1, amsgrad=True),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_bitwise_equal_to_torch(settings, dtype):
    compare_with_torch(
        lambda p: torch.optim.Adam(p, foreach=False, **settings), Adam(**settings), dtype=dtype
    )


@pytest.mark.parametrize("settings", [dict(lr=1e-2), *SETTINGS[1:], dict(lr=1e-2, weight_decay=0)])
def test_adamw_bitwise_equal_to_torch(settings):
    compare_with_torch(lambda p: torch.optim.AdamW(p, foreach=False, **settings), AdamW(**settings))


def test_adamw_default_weight_decay_is_torchs():
    assert AdamW().weight_decay == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]


def test_step_counts_are_per_parameter_like_torch():
    settings = dict(lr=1e-2, weight_decay=1e-3)
    optimizer = Adam(**settings)
    compare_with_torch(
        lambda p: torch.optim.Adam(p, foreach=False, **settings),
        optimizer,
        drop_grad=lambda step, name: name == "2.weight" and step % 3 == 0,
    )
    assert optimizer.state["2.weight"]["step"] == 5 and optimizer.state["0.weight"]["step"] == 8


def test_state_dict_resumes_exactly():
    grads = [{"w": torch.randn(5, generator=torch.Generator().manual_seed(i))} for i in range(6)]

    def run(split):
        optimizer = AdamW(lr=0.1, amsgrad=True)
        params = {"w": torch.zeros(5)}
        for step, grad in enumerate(grads):
            if step == split:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                buffer.seek(0)
                optimizer = AdamW(lr=0.1, amsgrad=True)
                optimizer.load_state_dict(torch.load(buffer))
            params = optimizer.step(params, grad, step)
        return params["w"]

    assert torch.equal(run(-1), run(3))


def test_inputs_untouched_and_state_bytes():
    optimizer = AdamW(lr=0.1, weight_decay=0.5)
    params, grads = {"w": torch.ones(4)}, {"w": torch.ones(4)}
    new = optimizer.step(params, grads, 0)
    assert torch.equal(params["w"], torch.ones(4)) and torch.equal(grads["w"], torch.ones(4))
    assert not torch.equal(new["w"], params["w"])
    assert optimizer.state_slots == 2 and optimizer.state_bytes() == 2 * 4 * 4


def test_velocity_is_the_last_step_per_unit_lr():
    optimizer = Adam(lr=0.1)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    assert optimizer.velocity("w") is None
    grads = {"w": torch.tensor([0.5, 3.0], dtype=torch.float64)}
    new = optimizer.step(params, grads, 0)
    # after one step m_hat = g and sqrt(s_hat) = |g|, so the step is lr * g / (|g| + eps)
    expected = grads["w"] / (grads["w"].abs() + 1e-8)
    torch.testing.assert_close(optimizer.velocity("w"), expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(params["w"] - new["w"], 0.1 * expected, rtol=1e-14, atol=0)


def test_adam_prediction_follows_the_adam_step():
    optimizer = Adam(lr=0.1, lwp_horizon=3)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    params = optimizer.step(params, {"w": torch.tensor([0.5, -3.0], dtype=torch.float64)}, 0)
    predicted = optimizer.predict(params, samples_seen=1)
    torch.testing.assert_close(predicted["w"], params["w"] - 0.3 * optimizer.velocity("w"))


def test_adamw_prediction_extrapolates_decay():
    optimizer = AdamW(lr=0.1, weight_decay=0.2)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    params = optimizer.step(params, {"w": torch.tensor([0.5, -3.0], dtype=torch.float64)}, 0)
    predicted = optimizer.predict(params, samples_seen=1, horizon=2)
    expected = params["w"] * (1 - 0.2 * 0.2) - 0.2 * optimizer.velocity("w")
    torch.testing.assert_close(predicted["w"], expected)


def test_bad_betas_are_clear_errors():
    with pytest.raises(ConfigError, match=r"betas\[1\]=1.0 must lie in \[0, 1\)"):
        Adam(betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="eps"):
        AdamW(eps=-1)
