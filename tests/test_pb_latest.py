"""Tests of pipetrain.pb.latest: backward through the weights current at backward time."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipetrain.pb.latest import LatestWeights

D = torch.float64


def _run(module: nn.Module, x: torch.Tensor, forward: dict, current: dict, gy_seed: int = 1):
    """Forward on ``forward`` under the hooks, backward after switching to ``current``."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in forward.items()}
    holder = {"params": leaves}
    xin = x.clone().requires_grad_(True)
    with LatestWeights(leaves, lambda: holder["params"]):
        out = functional_call(module, leaves, (xin,))
    holder["params"] = current
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(gy_seed), dtype=D)
    grads = torch.autograd.grad(out, [xin] + list(leaves.values()), gy)
    return out, gy, grads[0], dict(zip(leaves, grads[1:]))


def _versions(module: nn.Module, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = {n: p.detach().clone() for n, p in module.named_parameters()}
    new = {n: p + 0.3 * torch.randn(p.shape, generator=gen, dtype=D) for n, p in old.items()}
    return old, new


def _reference(module: nn.Module, x, gy, forward: dict, current: dict):
    """Input gradient through ``current``; weight gradients from ``forward``'s activations,
    computed directly: for these layers the weight gradient does not read the weights."""
    xin = x.clone().requires_grad_(True)
    out = functional_call(module, current, (xin,))
    (gx,) = torch.autograd.grad(out, [xin], gy)
    leaves = {n: t.clone().requires_grad_(True) for n, t in forward.items()}
    out = functional_call(module, leaves, (x,))
    gw = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), gy)))
    return gx, gw


@pytest.mark.parametrize(
    "module, shape",
    [
        (nn.Linear(5, 4), (3, 5)),
        (nn.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5)),
        (nn.Conv2d(2, 4, 3, stride=2, groups=2, bias=False), (1, 2, 7, 7)),
    ],
)
def test_linear_layers_propagate_through_current_weights(module, shape):
    # y is linear in x, so the input gradient depends on the weights only; the weight gradient
    # depends on the input only: both checks are exact statements about which version is read
    torch.manual_seed(0)
    module = module.double()
    x = torch.randn(shape, dtype=D)
    old, new = _versions(module)
    out, gy, gx, gw = _run(module, x, old, new)
    torch.testing.assert_close(out, functional_call(module, old, (x,)))
    ref_gx, ref_gw = _reference(module, x, gy, old, new)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-12, atol=1e-12)
    for name in gw:
        torch.testing.assert_close(gw[name], ref_gw[name], rtol=1e-12, atol=1e-12)
    # and it is not what stashing computes
    _, _, stash_gx, _ = _run(module, x, old, old)
    assert not torch.allclose(gx, stash_gx)


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 4), nn.LayerNorm(4)])
def test_norm_affine_parameters(norm):
    # y = xhat * gamma + beta: input gradient through the current gamma, gamma's gradient
    # from the stored xhat
    torch.manual_seed(1)
    norm = norm.double()
    x = torch.randn(3, 4, dtype=D)
    old, new = _versions(norm)
    _, gy, gx, gw = _run(norm, x, old, new)
    xin = x.clone().requires_grad_(True)
    (ref_gx,) = torch.autograd.grad(functional_call(norm, new, (xin,)), [xin], gy)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-12, atol=1e-12)
    xhat = functional_call(norm, {"weight": torch.ones(4, dtype=D), "bias": torch.zeros(4, dtype=D)}, (x,))
    torch.testing.assert_close(gw["weight"], (gy * xhat).sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw["bias"], gy.sum(0), rtol=1e-12, atol=1e-12)


def test_activations_stay_forward_time_in_a_nonlinear_stage():
    # Linear -> tanh -> Linear: the tanh derivative uses the forward-time pre-activation, the
    # error passes through the current second and first layers
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(1, 3, dtype=D)
    old, new = _versions(model)
    _, gy, gx, gw = _run(model, x, old, new)
    h = x @ old["0.weight"].T + old["0.bias"]
    a = torch.tanh(h)
    g_a = gy @ new["2.weight"]
    g_h = g_a * (1 - a * a)
    torch.testing.assert_close(gx, g_h @ new["0.weight"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw["2.weight"], gy.T @ a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw["0.weight"], g_h.T @ x, rtol=1e-12, atol=1e-12)


def test_parameters_sharing_one_flat_storage():
    # the batched engine's generic units compute with views into flat buffers
    torch.manual_seed(3)
    layer = nn.Linear(3, 2).double()
    flat_old = torch.randn(8, dtype=D)
    flat_new = torch.randn(8, dtype=D)
    old = {"weight": flat_old[:6].view(2, 3), "bias": flat_old[6:]}
    new = {"weight": flat_new[:6].view(2, 3), "bias": flat_new[6:]}
    leaves = {n: t.detach().requires_grad_(True) for n, t in old.items()}
    x = torch.randn(1, 3, dtype=D, requires_grad=True)
    with LatestWeights(leaves, lambda: new):
        out = functional_call(layer, leaves, (x,))
    (gx,) = torch.autograd.grad(out, [x], torch.ones(1, 2, dtype=D))
    torch.testing.assert_close(gx, torch.ones(1, 2, dtype=D) @ new["weight"])


def test_hooks_are_removed_on_exit():
    layer = nn.Linear(2, 2)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    with LatestWeights(params, lambda: params):
        pass
    x = torch.randn(1, 2, requires_grad=True)
    out = functional_call(layer, params, (x,))
    (gx,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(gx, params["weight"].sum(0, keepdim=True).detach())
