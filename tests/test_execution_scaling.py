"""A stage's part in float16's loss scale, on its own: stamps, the flag that travels back, the
skip decision and its state."""

from __future__ import annotations

import math

import pytest
import torch

from pipetrain.errors import NonFiniteError, PipetrainError
from pipetrain.execution.nonfinite import NonFiniteGuard
from pipetrain.execution.scaling import LossScale, StageScale

CPU = torch.device("cpu")


def test_stage_0_stamps_one_scale_per_update_and_the_next_stage_takes_it_off():
    scaler = LossScale(init=1024.0)
    first, second = StageScale(0, scaler, units_per_update=2, device=CPU), StageScale(1, scaler, 2, CPU)
    x = torch.ones(3)
    assert first.received(0, x, None) == (x, 1024.0)
    scaler.scale = 512.0  # moved after the update's first forward: its other microbatch keeps the stamp
    assert first.received(1, x, None)[1] == 1024.0
    assert first.received(2, x, None)[1] == 512.0
    sent = first.sent((x,), 1024.0)
    inputs, scale = second.received(0, sent, None)
    assert scale == 1024.0 and len(inputs) == 1 and inputs[0] is x
    assert second.received(0, x, stamp=64.0) == (x, 64.0)  # a replayed forward keeps its stamp


def test_the_gradients_that_arrive_lose_their_flag_and_must_share_the_updates_scale():
    scale = StageScale(1, LossScale(), 1, CPU)
    grad = torch.ones(2)
    assert scale.arrived(0, 8.0, (grad, torch.tensor([1.0]))) == ((grad,), True)
    assert scale.arrived(1, 8.0, None) == (None, False)  # the last stage: no flag
    with pytest.raises(PipetrainError, match="stage 1: microbatch 2 carries loss scale 4 but the update it joins has 8"):
        scale.arrived(2, 4.0, None)


def test_an_overflow_is_found_once_flagged_back_and_written_into_a_weight_gradient():
    scale = StageScale(2, LossScale(), 1, CPU)
    leaf = torch.zeros(3, requires_grad=True)
    leaf.grad = torch.ones(3)
    scale.test([leaf], flagged=False, grads=(torch.ones(2), None), weights=True)
    assert not scale.overflow and torch.equal(scale.flagged((None,))[1], torch.tensor([0.0]))
    scale.test([leaf], flagged=False, grads=(torch.tensor([1.0, math.inf]),), weights=False)
    assert scale.overflow and leaf.grad[0] == math.inf and torch.equal(leaf.grad[1:], torch.ones(2))
    assert torch.equal(scale.flagged(())[0], torch.tensor([1.0]))
    assert StageScale(0, LossScale(), 1, CPU).flagged((None,)) == (None,)  # stage 0 sends nothing back
    other = StageScale(1, LossScale(), 1, CPU)
    weights = torch.zeros(1, requires_grad=True)
    weights.grad = torch.tensor([math.nan])
    other.test([weights], flagged=False, grads=(), weights=False)  # the weights untested: no overflow
    assert not other.overflow
    other.test([weights], flagged=False, grads=(), weights=True)
    assert other.overflow


def test_an_update_that_overflowed_is_skipped_and_halves_stage_0s_scale():
    scaler = LossScale(init=1024.0, growth_interval=2)
    scale = StageScale(0, scaler, 1, CPU)
    guard = NonFiniteGuard(0, "stop")
    finite = {"w": torch.ones(2)}
    scale.arrived(0, 1024.0, None)
    assert scale.finish(1, finite, guard.check_skip_limit) == (False, 1.0 / 1024)
    assert scale.finish(2, {"w": torch.tensor([math.inf])}, guard.check_skip_limit) == (True, 1.0 / 1024)
    assert scaler.scale == 512.0 and scale.overflow_skipped == [2]
    scale.overflow = True  # flagged by a later stage
    assert scale.finish(3, finite, guard.check_skip_limit)[0] and not scale.overflow
    assert scale.scales == [1024.0, 1024.0, 512.0] and scaler.scale == 256.0
    follower = StageScale(1, LossScale(init=1024.0), 1, CPU)
    assert follower.finish(1, finite, guard.check_skip_limit) == (False, 1.0)  # no backward here: nothing to unscale


def test_a_fixed_scale_that_keeps_overflowing_stops_at_the_skip_limit():
    from pipetrain.execution.nonfinite import SKIP_LIMIT

    scale = StageScale(1, LossScale(init=8.0, dynamic=False), 1, CPU)
    guard = NonFiniteGuard(1, "stop")
    bad = {"w": torch.tensor([math.inf])}
    with pytest.raises(NonFiniteError, match=f"updates 1 to {SKIP_LIMIT} were all not finite"):
        for step in range(1, SKIP_LIMIT + 1):
            scale.finish(step, bad, guard.check_skip_limit)
    assert scale.overflow_skipped == list(range(1, SKIP_LIMIT + 1))


def test_the_state_continues_where_it_was():
    scale = StageScale(0, LossScale(init=64.0), 2, CPU)
    scale.received(0, torch.ones(1), None)
    scale.arrived(0, 64.0, None)
    scale.overflow = True
    scale.finish(1, {}, lambda *_: None)
    scale.received(2, torch.ones(1), None)
    scale.arrived(2, 32.0, None)
    state = scale.state_dict()
    again = StageScale(0, LossScale(), 2, CPU)
    again.load_state_dict(state)
    assert again.state_dict() == state and again.scaler.scale == 32.0 and again.pending == 32.0
    assert again.received(3, torch.ones(1), None)[1] == 32.0


def test_the_backward_halves_send_the_flag_and_test_what_each_has():
    leaf = torch.zeros(2, requires_grad=True)
    leaf.grad = torch.tensor([math.inf, 0.0])
    full = StageScale(1, LossScale(), 1, CPU)
    assert torch.equal(full.sent_back([leaf], False, (None,))[1], torch.tensor([1.0]))  # the weights tested
    split = StageScale(1, LossScale(), 1, CPU)
    assert torch.equal(split.sent_back_by_input_half([leaf], False, (None,))[1], torch.tensor([0.0]))
    split.tested_by_weight_half([leaf])
    assert split.overflow
    flagged = StageScale(1, LossScale(), 1, CPU)
    assert torch.equal(flagged.sent_back_by_input_half([], True, ())[0], torch.tensor([1.0]))  # passed on at once
    replica = StageScale(0, LossScale(), 1, CPU)
    replica.share(False)
    assert not replica.overflow
    replica.share(True)
    assert replica.overflow
