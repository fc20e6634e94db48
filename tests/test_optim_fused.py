"""The batched (foreach) optimizer path rounds exactly as the single-tensor path, whichever
tensors it writes into, and allocates no parameter memory when given them."""

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pipetrain.optim import SGD, Adam, AdamW, fused

SGD_OPTIONS = [
    dict(momentum=0.0),
    dict(momentum=0.0, weight_decay=0.01),
    dict(momentum=0.0, lwp_horizon=2.0),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(momentum=0.9, sc_delay=1.0),
    dict(momentum=0.9, sc_delay=2.5, dampening=0.2),
    dict(momentum=0.99, sc_delay=4.0, lwp_horizon=4.0, weight_decay=0.001),
]
ADAM_OPTIONS = [
    (Adam, dict()),
    (Adam, dict(weight_decay=0.01, amsgrad=True)),
    (AdamW, dict()),
    (AdamW, dict(weight_decay=0.1, amsgrad=True, lwp_horizon=2.0)),
]
CASES = [(SGD, o) for o in SGD_OPTIONS] + ADAM_OPTIONS


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (7, 5), "a.bias": (7,), "b.weight": (3, 7), "b.bias": (3,), "scalar": ()}
    return {n: torch.randn(s, generator=g, dtype=dtype).requires_grad_() for n, s in shapes.items()}


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    grads = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}
    if step % 3 == 1:  # a parameter without a gradient now and then: its step count falls behind
        grads["a.bias"] = None
    return grads


def _run(cls, options, dtype, mode, steps, single, monkeypatch):
    """``steps`` updates; ``mode``: where the new values go (in place, into another version's
    tensors, or new tensors). ``single``: force the per-tensor path."""
    with monkeypatch.context() as patch:
        if single:
            patch.setattr(fused, "available", lambda tensors: False)
        optimizer = cls(lr=0.05, **options)
        params = _params(dtype)
        spare = {n: torch.full_like(p, 7.0).requires_grad_() for n, p in params.items()}
        history, predictions, predicted = [], [], None
        for step in range(steps):
            out = {"in place": params, "spare": spare, "new": None}[mode]
            new = optimizer.step(params, _grads(params, step), samples_seen=4 * step, out=out)
            if mode == "spare":
                spare = {n: p for n, p in params.items() if new[n] is not p}
            params = new
            history.append({n: p.detach().clone() for n, p in params.items()})
            if optimizer.lwp_horizon:  # into the tensors of the last prediction, except in mode "new"
                made = optimizer.predict(params, 4 * step, out=None if mode == "new" else predicted)
                if predicted is not None and mode != "new":
                    assert all(made[n] is predicted[n] for n in predicted)
                predicted = {n: t for n, t in made.items() if t is not params[n]}
                predictions.append({n: p.detach().clone() for n, p in made.items()})
        return history, predictions, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["in place", "spare", "new"])
@pytest.mark.parametrize("cls, options", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
def test_batched_updates_round_exactly_as_the_single_tensor_path(cls, options, mode, dtype, monkeypatch):
    batched, batched_predictions, ours = _run(cls, options, dtype, mode, 7, False, monkeypatch)
    single, single_predictions, theirs = _run(cls, options, dtype, "new", 7, True, monkeypatch)
    for step, (a, b) in enumerate(zip(batched, single)):
        for name in a:
            assert torch.equal(a[name], b[name]), (name, step)
    for a, b in zip(batched_predictions, single_predictions):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name, slots in theirs.state.items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(ours.state[name][key]), torch.as_tensor(value)), (name, key)


def test_outputs_keep_requires_grad_and_parameters_without_gradients_keep_their_tensor():
    optimizer = SGD(lr=0.1, momentum=0.9)
    params = _params(torch.float32)
    params["frozen"] = torch.ones(2)
    grads = _grads(params, 0)
    grads["frozen"] = None
    new = optimizer.step(params, grads, 0)
    assert new["frozen"] is params["frozen"]
    assert all(new[n].requires_grad for n in new if n != "frozen") and not new["frozen"].requires_grad
    spare = {n: torch.zeros_like(p).requires_grad_() for n, p in new.items() if n != "frozen"}
    newer = optimizer.step(new, _grads(new, 3), 4, out=spare)
    assert all(newer[n] is spare[n] for n in spare)


@pytest.mark.parametrize("cls, options", [(SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
                                          (SGD, dict(momentum=0.9, sc_delay=3.0, lwp_horizon=3.0)),
                                          (SGD, dict(momentum=0.0, weight_decay=0.01, lwp_horizon=2.0)),
                                          (Adam, dict(weight_decay=0.1, lwp_horizon=2.0)),
                                          (AdamW, dict(weight_decay=0.1, amsgrad=True, lwp_horizon=2.0))])
def test_an_update_into_given_tensors_allocates_no_parameter_memory(cls, options):
    """After the first updates (state and scratch tensors made once), an update or a prediction
    written into given tensors allocates no parameter memory, counted by PyTorch's profiler
    (PyTorch's scalar arguments still make 4-byte tensors)."""
    optimizer = cls(lr=0.01, **options)
    params = {n: torch.randn(64, 64).requires_grad_() for n in ("w0", "w1", "w2")}
    spare = {n: torch.empty_like(p).requires_grad_() for n, p in params.items()}
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    predicted = {n: torch.empty_like(p) for n, p in params.items()}
    for step in range(3):
        params, spare = optimizer.step(params, grads, step, out=spare), params
        if optimizer.lwp_horizon:
            optimizer.predict(params, step, out=predicted)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for step, mode in zip(range(3, 53), itertools.cycle(["spare", "in place"])):
            if mode == "spare":
                params, spare = optimizer.step(params, grads, step, out=spare), params
            else:
                params = optimizer.step(params, grads, step, out=params)
            if optimizer.lwp_horizon:
                assert optimizer.predict(params, step, out=predicted)["w1"] is predicted["w1"]
    assert [e.name for e in prof.events() if e.cpu_memory_usage >= 64] == []
