"""The weight gradients summed inside autograd between updates, on their own."""

from __future__ import annotations

import torch

from pipetrain.execution.accumulation import GradientSums


def _leaves(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, generator=g).requires_grad_(), "b": torch.randn(1, generator=g).requires_grad_()}


def _backward(leaves: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    (leaves["w"] * x).sum().add(leaves["b"].sum() * 2).backward()


def test_the_sums_of_backwards_on_two_versions_are_those_of_the_separate_gradients():
    sums = GradientSums()
    assert sums.take() is None  # before a backward
    first, second = _leaves(0), _leaves(1)
    xs = [torch.randn(3) for _ in range(3)]
    for leaves, x in zip([first, first, second], xs):
        sums.open()
        sums.hold(first if leaves is first else second, leaves)
        _backward(leaves, x)
    assert first["w"].grad is None and second["w"].grad is not None  # the running sum moved to the second
    taken = sums.take()
    assert torch.equal(taken["w"], xs[0] + xs[1] + xs[2])
    assert torch.equal(taken["b"], torch.full((1,), 6.0))
    assert second["w"].grad is None and second["b"].grad is None  # taking them off the leaves


def test_holding_the_same_set_again_keeps_the_sums_where_they_are():
    sums = GradientSums()
    leaves = _leaves(0)
    sums.open()
    sums.hold(leaves, leaves)
    _backward(leaves, torch.ones(3))
    on_leaf = leaves["w"].grad
    sums.hold(leaves, leaves)
    assert leaves["w"].grad is on_leaf


def test_replacing_the_sums_clears_the_leaves():
    sums = GradientSums()
    leaves = _leaves(0)
    sums.open()
    sums.hold(leaves, leaves)
    _backward(leaves, torch.ones(3))
    sums.replace(None)
    assert leaves["w"].grad is None and sums.take() is None
    sums.open()
    assert sums.take() == {}  # a backward that differentiated nothing: no longer None
    given = {"w": torch.ones(3)}
    sums.replace(given)
    assert sums.take() is given
