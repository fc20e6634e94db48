"""A module called on a version's parameters, and parameters saved by a forward read back from the
backward's version, on their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import PipetrainError
from pipetrain.execution.parameters import ParamRef, Parameters, SavedParameters


class Tied(nn.Module):
    """An embedding and a head sharing its weight (two slots, one name)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_module_called_on_other_parameters_computes_with_them_and_keeps_its_own():
    module = Tied()
    call = Parameters(module)
    own = {n: p for n, p in module.named_parameters()}
    assert list(own) == ["embed.weight"]  # the head's slot reads the same name
    other = {"embed.weight": torch.randn(5, 3)}
    ids = torch.tensor([0, 3])
    expected = torch.func.functional_call(module, other, (ids,), tie_weights=True)
    assert torch.equal(call(other, (ids,)), expected)
    assert module.embed.weight is own["embed.weight"] and module.head.weight is own["embed.weight"]


def test_the_parameters_are_put_back_when_the_module_raises():
    module = nn.Linear(2, 2)
    weight = module.weight
    with pytest.raises(RuntimeError):
        Parameters(module)({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, (torch.ones(3),))
    assert module.weight is weight


def test_a_parameter_saved_by_the_forward_is_read_back_from_the_backwards_version():
    # y = x @ w.T: the input's gradient reads w, which the backward resolves to its own version
    forward_w = torch.randn(3, 4, requires_grad=True)
    backward_w = torch.randn(3, 4)
    x = torch.randn(2, 4, requires_grad=True)
    saved = SavedParameters()
    with saved.recording({forward_w.untyped_storage().data_ptr(): "w"}):
        y = torch.nn.functional.linear(x, forward_w)
    grad = torch.randn(2, 3)
    with saved.resolving({"w": backward_w}):
        (gx,) = torch.autograd.grad(y, (x,), grad)
    assert torch.equal(gx, grad @ backward_w)
    with pytest.raises(PipetrainError, match="outside a backward"):  # the reference needs a version
        with saved.recording({forward_w.untyped_storage().data_ptr(): "w"}):
            y = torch.nn.functional.linear(x, forward_w)
        torch.autograd.grad(y.sum(), (x,))


def test_a_reference_keeps_the_view_it_was_made_of():
    base = torch.arange(12.0).reshape(3, 4)
    view = base[1:, 1::2]
    ref = ParamRef("w", view)
    other = torch.arange(12.0).reshape(3, 4) * 10
    assert torch.equal(other.as_strided(ref.size, ref.stride, ref.offset), other[1:, 1::2])
