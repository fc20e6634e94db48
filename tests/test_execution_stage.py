"""StageExecutor: gradient accumulation inside autograd and updates in place of a released version."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.execution import StageExecutor
from pipetrain.optim import Adam, SGD


def _module(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(count)]


def test_backward_accumulates_exactly_what_separate_gradients_sum_to():
    module, batches = _module(), _batches(3)
    executor = StageExecutor(1, module, None, loss_fn=F.cross_entropy)
    input_grads = []
    for k, (x, y) in enumerate(batches):
        executor.forward(k, 0, x, target=y, loss_scale=1 / 3, samples=5)
        input_grads.append(executor.backward(k, 0)[0])

    reference = _module()
    params = dict(reference.named_parameters())
    expected = {name: None for name in params}
    for (x, y), got in zip(batches, input_grads):
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(reference(x), y) * (1 / 3)
        grads = torch.autograd.grad(loss, [x, *params.values()])
        assert torch.equal(got, grads[0])
        for name, grad in zip(params, grads[1:]):
            expected[name] = grad if expected[name] is None else expected[name].add_(grad)
    assert executor.pending_samples == 15
    # between backwards the running sums stay on the version's autograd leaves ...
    assert all(leaf.grad is not None for leaf in executor._leaves[0].values())
    for name, grad in expected.items():
        assert torch.equal(executor.grads[name], grad), name
    # ... and reading them takes them off
    assert all(leaf.grad is None for leaf in executor._leaves[0].values())


@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01), lambda: Adam(lr=0.01)])
def test_an_update_that_releases_the_current_version_is_made_in_place_with_the_same_bits(optimizer):
    in_place = StageExecutor(1, _module(), optimizer(), loss_fn=F.cross_entropy)
    copied = StageExecutor(1, _module(), optimizer(), loss_fn=F.cross_entropy)
    for step, (x, y) in enumerate(_batches(4)):
        for executor, release in ((in_place, [step]), (copied, [])):
            executor.forward(step, step, x, target=y, samples=5)
            executor.backward(step, step)
            before = {name: t.data_ptr() for name, t in executor.versions.latest.items()}
            executor.step(release)
            after = {name: t.data_ptr() for name, t in executor.versions.latest.items()}
            assert (after == before) == bool(release)
        for name, value in in_place.versions.latest.items():
            assert torch.equal(value, copied.versions.latest[name]), name


def test_a_version_still_read_is_never_overwritten():
    # PipeDream's stage 0 with warm-up 1: microbatch 1 reads version 0 after the update that
    # follows microbatch 0's backward.
    executor = StageExecutor(0, _module(), SGD(lr=0.1))
    batches = _batches(2)
    executor.forward(0, 0, batches[0][0], samples=5)
    executor.forward(1, 0, batches[1][0], samples=5)
    version0 = {name: t.clone() for name, t in executor.versions[0].items()}
    executor.backward(0, 0, (torch.ones(5, 3),))
    executor.step([])  # version 0 is still read by microbatch 1
    for name, value in executor.versions[0].items():
        assert torch.equal(value, version0[name]), name
    executor.backward(1, 0, (torch.ones(5, 3),))
    executor.step([0])
    assert executor.versions.held() == [1, 2]
