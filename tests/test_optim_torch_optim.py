"""torch.optim classes and lr schedulers on versioned stages (pipetrain.optim.torch_optim)."""

import pytest
import torch

from pipetrain.errors import ConfigError
from pipetrain.optim import SGD
from pipetrain.optim.torch_optim import SchedulerLR, TorchOptimizer, as_spec, is_torch_optimizer


def test_torch_sgd_adam_adamw_become_pipetrains_own_optimizers():
    assert str(as_spec(torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False))) == "sgd:lr=0.1,momentum=0.9"
    assert str(as_spec(torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.99)))) == "adam:lr=0.001,betas=0.8/0.99"
    assert as_spec(torch.optim.AdamW, {}).name == "adamw"
    assert as_spec(torch.optim.SGD, dict(lr=0.1, foreach=True)) is None  # other arithmetic: run torch's own
    assert as_spec(torch.optim.RMSprop, dict(lr=0.1)) is None
    assert is_torch_optimizer(torch.optim.RMSprop) and not is_torch_optimizer(torch.optim.RMSprop([torch.zeros(1)]))


def _params():
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}


def test_a_torch_optimizer_never_changes_the_version_it_reads_unless_told_to():
    params, grads = _params(), {"w": torch.ones(4, 3), "b": torch.ones(3)}
    before = {n: t.clone() for n, t in params.items()}
    optimizer = TorchOptimizer(torch.optim.RMSprop, dict(lr=0.1))
    new = optimizer.step(params, grads, 0)
    assert all(torch.equal(params[n], before[n]) for n in params)  # the old version is intact (stashed readers)
    again = optimizer.step(new, grads, 8, out=new)  # nothing reads ``new`` any more: in place
    assert again["w"] is new["w"]
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in before.items()}
    torch_opt = torch.optim.RMSprop(list(reference.values()), lr=0.1)
    for _ in range(2):
        for n, p in reference.items():
            p.grad = grads[n].clone()
        torch_opt.step()
    assert all(torch.equal(again[n], reference[n].detach()) for n in params)


def test_a_torch_optimizers_state_resumes_exactly():
    grads = {"w": torch.full((4, 3), 0.5), "b": torch.full((3,), -0.5)}
    first = TorchOptimizer(torch.optim.Adagrad, dict(lr=0.1))
    params = first.step(_params(), grads, 0)
    saved = first.state_dict()
    second = TorchOptimizer(torch.optim.Adagrad, dict(lr=0.1))
    second.load_state_dict(saved)
    a, b = first.step(params, grads, 8), second.step({n: t.clone() for n, t in params.items()}, grads, 8)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ConfigError, match="resume with the optimizer"):
        TorchOptimizer(torch.optim.Adagrad, dict(lr=0.2)).load_state_dict(saved)
    with pytest.raises(ConfigError, match="Linear Weight Prediction"):
        first.predict(params, 0, horizon=2)


def test_a_torch_scheduler_sets_the_rate_of_each_update():
    optimizer = SGD(lr=1.0)
    optimizer.lr_schedule = SchedulerLR(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 3], gamma=0.5), optimizer)
    rates = []
    params = {"w": torch.zeros(1)}
    for _ in range(5):
        rates.append(optimizer.lr_at(0))
        params = optimizer.step(params, {"w": torch.ones(1)}, 0)
    assert rates == [1.0, 1.0, 0.5, 0.25, 0.25]
    assert torch.equal(params["w"], torch.tensor([-3.0]))
