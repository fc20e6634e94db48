"""Tests of pipetrain.pb.kernels and pipetrain.pb.lowering: stacked units equal autograd per member."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipetrain.models import BasicBlock, BlockHead, BlockTail, ResidualBlock, Shortcut
from pipetrain.pb import block_kernels as blocks
from pipetrain.pb import kernels as K
from pipetrain.pb import layer_kernels as layers
from pipetrain.pb.latest import LatestWeights
from pipetrain.pb.lowering import LOWERINGS, lower, register_lowering

D = torch.float64


def _members(module: nn.Module, count: int, seed: int):
    """``count`` different weight sets for ``module`` (name -> tensor)."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(count):
        sets.append({n: p.detach() + 0.5 * torch.randn(p.shape, generator=gen, dtype=D)
                     for n, p in module.named_parameters()})
    return sets


def _check(module: nn.Module, in_shape: tuple[int, ...], *, count: int = 3, batch: int = 1, seed: int = 0):
    """Kernel forward/backward for ``count`` stacked members == autograd on each member, and the
    backward may use other weights than the forward (the PB case)."""
    module = module.double()
    kernel = lower(module)
    assert kernel is not None, type(module)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn((count, batch) + in_shape, generator=gen, dtype=D)
    fwd = _members(module, count, seed)
    cur = _members(module, count, seed + 7)
    out_shape = kernel.bind(in_shape)
    names = [n for n, _ in kernel.params]
    stack = lambda sets: [torch.stack([s[n] for s in sets]) for n in names]  # noqa: E731
    y, saved = kernel.forward(kernel.prepare(stack(fwd)), x)
    assert y.shape == (count, batch) + out_shape
    gy = torch.randn(y.shape, generator=gen, dtype=D)
    gx, grads = kernel.backward(kernel.prepare(stack(cur)), saved, gy, True)
    grads = [K.materialize(g) for g in grads]
    for i in range(count):
        ref = functional_call(module, fwd[i], (x[i],))
        torch.testing.assert_close(y[i], ref, rtol=1e-10, atol=1e-10)
        # the reference: autograd with the generic `latest` hooks (forward on fwd, backward on cur)
        leaves = {n: t.clone().requires_grad_(True) for n, t in fwd[i].items()}
        xin = x[i].clone().requires_grad_(True)
        with LatestWeights(leaves, lambda i=i: cur[i]):
            out = functional_call(module, leaves, (xin,))
        latest = torch.autograd.grad(out, [xin] + [leaves[n] for n in names], gy[i])
        torch.testing.assert_close(gx[i], latest[0], rtol=1e-10, atol=1e-10)
        for name, got, want in zip(names, grads, latest[1:]):
            torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-10, msg=name)
    return kernel


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "module, in_shape",
    [
        (nn.Linear(5, 4), (5,)),
        (nn.Linear(5, 4, bias=False), (2, 5)),
        (nn.GroupNorm(2, 4), (4,)),
        (nn.GroupNorm(2, 4), (4, 3, 3)),
        (nn.GroupNorm(2, 4, affine=False), (4, 2, 2)),
        (nn.LayerNorm(6), (6,)),
        (nn.LayerNorm([2, 3]), (4, 2, 3)),
        (nn.GELU(), (7,)),
        (nn.GELU(approximate="tanh"), (7,)),
        (nn.ReLU(), (7,)),
        (nn.Tanh(), (7,)),
        (nn.Sigmoid(), (7,)),
        (nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)),
        (nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False), (4, 6, 6)),
        (nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten()), (16,)),
        (nn.Sequential(nn.Identity(), nn.Dropout(0.0), nn.Linear(3, 3)), (3,)),
        (ResidualBlock(nn.GroupNorm(2, 4), 4, 8, nn.GELU), (4,)),
        (ResidualBlock(nn.LayerNorm(4), 4, 4, nn.ReLU), (4,)),
        (BasicBlock(4, 2), (4, 5, 5)),
        (BasicBlock(4, 2, out_channels=6, stride=2), (4, 5, 5)),
        (BlockHead(4, 2), (4, 4, 4)),
        (BlockHead(2, 2, out_channels=4, stride=2), (2, 5, 5)),
        (BlockTail(4, 2), (8, 3, 3)),
        (nn.Sequential(BlockHead(2, 1, out_channels=4, stride=2), BlockTail(4, 2)), (2, 4, 4)),
        (Shortcut(2, 5, 2), (2, 5, 4)),
    ],
)
def test_kernel_matches_autograd_with_latest_weights(module, in_shape, batch):
    _check(module, in_shape, batch=batch)


@pytest.mark.parametrize("count, batch", [(8, 1), (2, 4)])
def test_convolution_on_many_members_runs_grouped(count, batch):
    # from 64 output pixels and 8 members x samples the kernel switches to the grouped convolution
    kernel = _check(nn.Conv2d(3, 4, 3, padding=1), (3, 8, 8), count=count, batch=batch)
    assert kernel._grouped(count, batch) and not kernel._grouped(1, 1)
    small = _check(nn.Conv2d(3, 4, 3, padding=1), (3, 4, 4), count=count, batch=batch)
    assert not small._grouped(count, batch)  # 16 output pixels: patches times weights


def test_outer_gradient_is_the_weight_gradient():
    kernel = layers.Linear(3, 2, bias=True)
    kernel.bind((3,))
    x = torch.randn(4, 1, 3, dtype=D)
    w = torch.randn(4, 2, 3, dtype=D)
    b = torch.randn(4, 2, dtype=D)
    _, saved = kernel.forward(kernel.prepare([w, b]), x)
    gy = torch.randn(4, 1, 2, dtype=D)
    _, grads = kernel.backward(kernel.prepare([w, b]), saved, gy, False)
    assert isinstance(grads[0], K.Outer)
    torch.testing.assert_close(K.materialize(grads[0]), gy.transpose(1, 2) @ x)


def test_signatures_separate_shapes_and_kinds():
    a, b, c = lower(nn.Linear(4, 4)), lower(nn.Linear(4, 4)), lower(nn.Linear(4, 5))
    assert a.signature() == b.signature() != c.signature()
    assert lower(nn.GELU()).signature() != lower(nn.GELU(approximate="tanh")).signature()


def test_uncovered_modules_are_not_lowered():
    class MyLinear(nn.Linear):  # a subclass may change forward: exact types only
        def forward(self, x):
            return super().forward(x) * 2

    assert lower(MyLinear(3, 3)) is None
    assert lower(nn.Dropout(0.5)) is None  # random in training mode
    assert lower(nn.Dropout(0.5).eval()) is not None
    assert lower(nn.BatchNorm1d(3)) is None
    assert lower(nn.Sequential(nn.Linear(3, 3), nn.ELU())) is None
    assert lower(nn.AdaptiveAvgPool2d(2)) is None
    assert lower(nn.Conv2d(1, 1, 3, padding="same")) is None


def test_register_lowering_for_a_user_module():
    class Scale2(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x)

    assert lower(Scale2()) is None
    register_lowering(Scale2, lambda m: blocks.Chain([("lin", lower(m.lin))]))
    try:
        _check(Scale2(), (3,))
    finally:
        del LOWERINGS[Scale2]
