"""A microbatch's in-flight record and a stage's table of them, on their own."""

from __future__ import annotations

import pytest
import torch

from pipetrain.errors import PipetrainError
from pipetrain.execution.inflight import InFlight, InFlightTable, constants_of


def _record(microbatch: int = 0, version: int = 0, roots: tuple = (), **fields) -> InFlight:
    return InFlight((), roots, {}, samples=1, version=version, microbatch=microbatch, **fields)


def test_the_loss_differentiated_carries_the_share_of_the_batch_and_the_loss_scale():
    loss = torch.tensor(0.3)
    assert _record().scaled(loss) is loss  # nothing to multiply
    assert torch.equal(_record(loss_scale=0.25, scale=1024.0).scaled(loss), loss * 256.0)


def test_only_the_inputs_that_take_a_gradient_get_one_back():
    x, ids, mask = torch.ones(2, requires_grad=True), torch.tensor([1, 2]), torch.ones(2)
    record = InFlight((x, ids, mask, 3), (), {}, samples=2)
    assert record.input_positions() == [0]
    grad = torch.full((2,), 2.0)
    assert record.input_gradients([0], [grad]) == (grad, None, None, None)


def test_the_table_refuses_a_microbatch_twice_and_a_backward_without_its_forward():
    table = InFlightTable(stage=3)
    table[5] = _record(5)
    with pytest.raises(PipetrainError, match="stage 3: microbatch 5 is already in flight"):
        table.check_new(5)
    table.check_new(6)
    record = table.record(5)
    assert table.take(5) is record
    assert 5 not in table
    with pytest.raises(PipetrainError, match="stage 3: backward of microbatch 5, whose forward has not run here"):
        table.take(5)


def test_a_version_awaits_recomputation_while_a_microbatch_that_read_it_has_no_graph():
    table = InFlightTable(stage=0)
    table[0] = _record(0, version=1)  # recomputing: no roots yet
    table[1] = _record(1, version=2, roots=(torch.ones(1),))
    assert table.awaits_recomputation(1)
    assert not table.awaits_recomputation(2) and not table.awaits_recomputation(3)


def test_the_outputs_that_need_no_gradient_are_marked_for_the_next_stage():
    x = torch.ones(2, requires_grad=True)
    mask, ids = torch.ones(2), torch.tensor([1])
    h = x * 2
    assert constants_of((h, mask, ids, torch.zeros(1)), (x, mask), recomputed=False) == 0b1010
    # without a graph only an input handed on unchanged is known to need none
    assert constants_of((h.detach(), mask, torch.zeros(1)), (x, mask), recomputed=True) == 0b10


def test_only_outputs_that_got_a_gradient_are_differentiated():
    x = torch.ones(2, requires_grad=True)
    used, unused, constant = x * 2, x * 3, torch.ones(2)
    record = _record(roots=(used, unused, constant))
    grad = torch.ones(2)
    roots, grads = record.differentiable((grad, None, torch.ones(2)))
    assert len(roots) == 1 and roots[0] is used and grads == [grad]
    loss = (x * 4).sum()
    assert _record(roots=(loss,)).differentiable(None) == ([loss], None)  # the last stage: its loss


def test_a_forwards_floating_inputs_take_a_gradient_on_later_stages_unless_constant():
    from pipetrain.execution.inflight import forward_inputs

    x, mask, ids = torch.ones(2), torch.ones(2), torch.tensor([1])
    leaves, structure = forward_inputs({"x": x, "mask": mask, "ids": ids}, torch.device("cpu"), True,
                                       constants=0b010)
    flat = structure.unflatten(leaves)  # dict leaves in key order: x, mask, ids
    assert flat["x"].requires_grad and not flat["mask"].requires_grad and not flat["ids"].requires_grad
    first, none = forward_inputs(x, torch.device("cpu"), False, 0)
    assert none is None and first[0] is x and not first[0].requires_grad  # stage 0: as it is
