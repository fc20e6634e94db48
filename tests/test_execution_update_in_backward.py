"""Updates made during the backward of a one-microbatch update: bitwise those made after it."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from pipetrain.execution import StageExecutor
from pipetrain.optim import build_stage_optimizer


def stage():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def train(module, spec, fused, microbatches, updates=4):
    executor = StageExecutor(0, module, build_stage_optimizer(spec, stage_delay=0), loss_fn=nn.functional.cross_entropy,
                             update_in_backward=fused, units_per_update=microbatches)
    g = torch.Generator().manual_seed(1)
    whole_gradients = []
    for update in range(updates):
        for part in range(microbatches):
            k = update * microbatches + part
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            executor.forward(k, update, x, target=y, loss_scale=1 / microbatches, samples=4)
            executor.backward(k, update)
        whole_gradients.append(bool(executor.grads))
        executor.step([update])
    return executor.versions.latest, whole_gradients


@pytest.mark.parametrize("spec", ["sgd:lr=0.1,momentum=0.9,weight_decay=0.01", "adam:lr=0.01", "adamw:lr=0.01"])
def test_updating_in_the_backward_equals_updating_after_it(spec):
    after, held = train(stage(), spec, fused=False, microbatches=1)
    during, held_fused = train(stage(), spec, fused=True, microbatches=1)
    assert all(held) and not any(held_fused)  # the fused stage never held its gradient at the step
    assert all(torch.equal(after[name], during[name]) for name in after)


def test_an_update_of_several_microbatches_accumulates_as_before():
    after, _ = train(stage(), "sgd:lr=0.1,momentum=0.9", fused=False, microbatches=2)
    during, held = train(stage(), "sgd:lr=0.1,momentum=0.9", fused=True, microbatches=2)
    assert all(held) and all(torch.equal(after[name], during[name]) for name in after)


def test_a_stage_updates_in_its_backward_only_when_wanted_and_its_optimizer_can():
    from pipetrain.execution.update_in_backward import UpdateInBackward, fused_update
    from pipetrain.optim import SGD

    assert isinstance(fused_update(SGD(lr=0.1), wanted=True), UpdateInBackward)
    assert fused_update(SGD(lr=0.1), wanted=False) is None
    assert fused_update(None, wanted=True) is None  # no optimizer: no update

    class Changed(SGD):
        def step(self, *args, **kwargs):  # an optimizer whose step is not its per-parameter update
            return super().step(*args, **kwargs)

    assert fused_update(Changed(lr=0.1), wanted=True) is None
