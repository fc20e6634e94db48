"""Interleaved zero bubble (ZB1P): torch's order, its rounds, and W filling the bubbles."""

import pytest
from torch_orders import compute_order, torch_order

from pipetrain.errors import ScheduleError
from pipetrain.schedule import Costs, build, check, order, simulate


@pytest.mark.parametrize("ranks,chunks", [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 6, 8])
def test_order_is_torchs(ranks, chunks, microbatches):
    if microbatches % max(1, microbatches // ranks):
        pytest.skip("torch refuses it too")
    schedule = order("interleaved-zb", ranks, microbatches, chunks=chunks)
    assert compute_order(schedule) == torch_order("ScheduleInterleavedZeroBubble", ranks, chunks, microbatches)


def test_fills_interleaveds_bubbles_with_w():
    costs = Costs(F=1, B=1, W=1)
    zb = build("InterleavedZeroBubble", 4, 8, chunks=2, steps=2)
    check(zb)
    plain = build("interleaved", 4, 8, chunks=2, steps=2)
    assert simulate(zb, costs).makespan < simulate(plain, costs).makespan


def test_rounds_must_divide_the_microbatches():
    with pytest.raises(ScheduleError, match="multiple of 2; got 9: use microbatches=8 or microbatches=10"):
        order("interleaved-zb", 4, 9, chunks=2)
