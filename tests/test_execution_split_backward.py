"""The split backward: W starts from what I kept, never runs the input part again, and adds the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.execution import StageExecutor
from pipetrain.execution.split_backward import input_half, plan


class Counted(nn.Module):
    """GELU whose backward counts its runs (a hook on its output: a pre-hook on its autograd node)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(x)
        if y.requires_grad:
            y.register_hook(self._count)
        return y

    def _count(self, grad: torch.Tensor) -> None:
        self.runs += 1


def _module(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), Counted(), nn.Linear(8, 8), Counted(), nn.Linear(8, 3))


def _batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(count)]


@pytest.mark.parametrize("recompute", [False, True])
def test_w_never_runs_the_input_part_again_and_adds_the_bits_of_a_full_backward(recompute):
    split = StageExecutor(1, _module(), None, recompute=recompute)
    full = StageExecutor(1, _module(), None, recompute=recompute)
    batches = _batches(3)
    for k, (x, _) in enumerate(batches):
        split.forward(k, 0, x, samples=5)
        full.forward(k, 0, x, samples=5)
    for k, (_, g) in enumerate(batches):
        got = split.backward_input(k, 0, (g,))
        assert split.in_flight[k].roots == ()  # the graph above the weights' part is gone after I
        assert torch.equal(got[0], full.backward(k, 0, (g,))[0])
    for k in range(3):
        split.backward_weight(k, 0)
    # each GELU's backward ran once per microbatch over I and W together (a second backward: twice)
    assert [m.runs for m in split.module if isinstance(m, Counted)] == [3, 3]
    assert split.in_flight == {}
    expected = full.grads
    for name, grad in split.grads.items():
        assert torch.equal(grad, expected[name]), name


def _reference(roots, grads, inputs, leaves):
    return torch.autograd.grad(roots, [*inputs, *leaves], grads, allow_unused=True)


def _split(roots, grads, inputs, leaves):
    results, half = input_half(roots, grads, inputs, leaves)
    assert half is not None
    half.run()
    return (*results, *(leaf.grad for leaf in leaves))


def test_a_weight_used_twice_on_the_input_path_an_unused_one_and_an_output_no_input_reaches():
    torch.manual_seed(0)
    w, unused, b = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    x = torch.randn(3, 4, requires_grad=True)

    def graph():
        h = torch.tanh(x @ w)
        return [torch.tanh(h @ w), b * 2], [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),
                                           torch.ones(4, 4)]

    roots, grads = graph()
    expected = _reference(roots, grads, [x], [w, unused, b])
    roots, grads = graph()
    got = _split(roots, grads, [x], [w, unused, b])
    assert got[2] is None  # no gradient for a weight this microbatch did not use, as in a full backward
    for a, e in zip(got, expected):
        assert (a is None and e is None) or torch.equal(a, e)


def test_a_weight_whose_gradient_sums_three_contributions_keeps_the_plain_path():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = (x @ w) @ w + x @ w
    assert plan([out], [torch.ones(3, 4)], [x], [w]) is None
    assert plan([x @ w], [torch.ones(3, 4)], [x], [w]) is not None


class Thrice(nn.Module):
    """One Linear applied three times: its weight's gradient sums three contributions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(torch.tanh(self.linear(x)))))


def test_the_plain_path_a_stage_keeps_adds_the_bits_of_a_full_backward():
    split, full = StageExecutor(1, Thrice(), None), StageExecutor(1, Thrice(), None)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(2)]
    for k, (x, dy) in enumerate(batches):
        split.forward(k, 0, x, samples=3)
        full.forward(k, 0, x, samples=3)
        assert torch.equal(split.backward_input(k, 0, (dy,))[0], full.backward(k, 0, (dy,))[0])
        assert split.in_flight[k].weight_half is None and split.in_flight[k].roots  # kept for a second backward
        split.backward_weight(k, 0)
    expected = full.grads
    for name, grad in split.grads.items():
        assert torch.equal(grad, expected[name]), name
