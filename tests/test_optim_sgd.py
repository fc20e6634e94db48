import io

import pytest
import torch
from torch import nn
from torch.func import functional_call

from optim_helpers import batches, compare_with_torch, small_model
from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.optim import SGD

SETTINGS = [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(lr=0.02, momentum=0.99, dampening=0.1, weight_decay=5e-4),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitwise_equal_to_torch_sgd(settings, dtype):
    compare_with_torch(
        lambda p: torch.optim.SGD(p, foreach=False, **settings), SGD(**settings), dtype=dtype
    )


def test_none_gradients_skip_like_torch():
    settings = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    compare_with_torch(
        lambda p: torch.optim.SGD(p, foreach=False, **settings),
        SGD(**settings),
        drop_grad=lambda step, name: name == "0.bias" and step in (0, 3, 4),
    )


def test_inputs_untouched_and_outputs_new_leaves():
    optimizer = SGD(lr=0.1, momentum=0.9, weight_decay=0.1)
    params = {"w": torch.randn(3, 4).requires_grad_(), "b": torch.randn(4)}
    grads = {"w": torch.randn(3, 4), "b": None}
    before = {n: p.detach().clone() for n, p in params.items()}
    grad_before = grads["w"].clone()
    for _ in range(3):
        new = optimizer.step(params, grads, samples_seen=0)
    assert all(torch.equal(params[n], before[n]) for n in params)
    assert torch.equal(grads["w"], grad_before)
    assert new["w"] is not params["w"] and new["w"].is_leaf and new["w"].requires_grad
    assert new["b"] is params["b"]
    assert "b" not in optimizer.state


def test_autograd_saved_weights_survive_an_update():
    """Why the optimizer is functional: a backward after a step still sees the old weights."""
    model = small_model()
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    x, y = next(batches(1))
    loss = nn.functional.cross_entropy(functional_call(model, params, (x,)), y)
    expected = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
    optimizer = SGD(lr=0.5, momentum=0.9)
    new = optimizer.step(params, dict(zip(params, expected)), samples_seen=0)
    again = torch.autograd.grad(loss, list(params.values()))  # would raise after an in-place update
    assert all(torch.equal(a, b) for a, b in zip(expected, again))
    assert not any(torch.equal(new[n], params[n]) for n in params)


def test_state_dict_resumes_exactly():
    def run(split):
        model = small_model()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)
        for step, (x, y) in enumerate(batches(8)):
            if step == split:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                buffer.seek(0)
                optimizer = SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)
                optimizer.load_state_dict(torch.load(buffer))
            leaves = {n: p.requires_grad_() for n, p in params.items()}
            loss = nn.functional.cross_entropy(functional_call(model, leaves, (x,)), y)
            grads = dict(zip(params, torch.autograd.grad(loss, list(leaves.values()))))
            params = {n: p.detach() for n, p in optimizer.step(leaves, grads, 4 * step).items()}
        return params, optimizer.steps

    straight, steps = run(split=-1)
    resumed, resumed_steps = run(split=4)
    assert steps == resumed_steps == 8
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)


def test_state_dict_is_a_snapshot_and_checks_the_kind():
    optimizer = SGD(lr=0.1, momentum=0.9)
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    optimizer.step(params, grads, 0)
    saved = optimizer.state_dict()
    optimizer.step(params, grads, 1)
    assert torch.equal(saved["state"]["w"]["momentum_buffer"], torch.ones(2))
    from pipetrain.optim import Adam

    with pytest.raises(ConfigError, match="'sgd' optimizer state into a 'adam'"):
        Adam().load_state_dict(saved)


def test_velocity_is_torch_momentum_buffer():
    model = small_model()
    reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ours = SGD(lr=0.1, momentum=0.9)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step, (x, y) in enumerate(batches(3)):
        reference.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        reference.step()
        params = ours.step(params, grads, step)
    for name, p in model.named_parameters():
        assert torch.equal(ours.velocity(name), reference.state[p]["momentum_buffer"])
    assert ours.velocity("missing") is None


def test_bad_settings_and_gradients_are_clear_errors():
    with pytest.raises(ConfigError, match="nesterov=true needs momentum > 0 and dampening=0"):
        SGD(lr=0.1, nesterov=True)
    with pytest.raises(ConfigError, match="lr=-1"):
        SGD(lr=-1)
    with pytest.raises(ConfigError, match="momentum=-0.5"):
        SGD(lr=0.1, momentum=-0.5)
    optimizer = SGD(lr=0.1)
    with pytest.raises(PipetrainError, match="unknown parameters"):
        optimizer.step({"w": torch.ones(2)}, {"v": torch.ones(2)}, 0)
    with pytest.raises(PipetrainError, match="shape"):
        optimizer.step({"w": torch.ones(2)}, {"w": torch.ones(3)}, 0)


def test_schedule_sets_the_rate_of_each_update():
    from pipetrain.optim import StepLR

    optimizer = SGD(lr=1.0, lr_schedule=StepLR(milestones=(10,), gamma=0.5))
    w = {"w": torch.zeros(1, dtype=torch.float64)}
    g = {"w": torch.ones(1, dtype=torch.float64)}
    w = optimizer.step(w, g, samples_seen=9)
    assert w["w"].item() == -1.0
    w = optimizer.step(w, g, samples_seen=10)
    assert w["w"].item() == -1.5
    assert optimizer.state_slots == 0 and optimizer.state_bytes() == 0
