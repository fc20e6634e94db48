"""Helpers of the optim tests: one small model trained by torch.optim and by pipetrain.optim."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from pipetrain.optim import StageOptimizer

__all__ = ["small_model", "compare_with_torch", "batches"]


def small_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batches(count: int, dtype: torch.dtype = torch.float32, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randn(4, 5, generator=generator, dtype=dtype)
        y = torch.randint(0, 3, (4,), generator=generator)
        yield x, y


def compare_with_torch(
    make_reference: Callable[..., torch.optim.Optimizer],
    ours: StageOptimizer,
    steps: int = 8,
    dtype: torch.dtype = torch.float32,
    drop_grad: Callable[[int, str], bool] = lambda step, name: False,
) -> dict[str, torch.Tensor]:
    """Train the same model with both optimizers; assert bitwise-equal parameters after each step.

    ``drop_grad(step, name)`` makes a parameter's gradient None at that step for both optimizers.
    """
    model = small_model(dtype)
    reference = copy.deepcopy(model)
    optimizer = make_reference(reference.parameters())
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    loss_fn = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches(steps, dtype)):
        optimizer.zero_grad()
        loss_fn(reference(x), y).backward()
        for name, p in reference.named_parameters():
            if drop_grad(step, name):
                p.grad = None
        optimizer.step()

        loss = loss_fn(functional_call(model, params, (x,)), y)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        grads = {n: (None if drop_grad(step, n) else g) for n, g in grads.items()}
        params = ours.step(params, grads, samples_seen=4 * step)
        for name, p in reference.named_parameters():
            assert torch.equal(p.detach(), params[name]), f"{name} differs at step {step}"
    return params
