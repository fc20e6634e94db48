"""Looped BFS: torch's order, its placement, and what it holds."""

import pytest
from torch_orders import compute_order, torch_order

from pipetrain.errors import ScheduleError
from pipetrain.schedule import build, check, memory_by_rank, order, simulate


@pytest.mark.parametrize("ranks,chunks", [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("microbatches", [1, 3, 4, 8])
def test_order_is_torchs(ranks, chunks, microbatches):
    schedule = order("bfs", ranks, microbatches, chunks=chunks)
    assert compute_order(schedule) == torch_order("ScheduleLoopedBFS", ranks, chunks, microbatches)


def test_looped_placement_and_every_microbatch_in_flight():
    schedule = build("LoopedBFS", 2, 5, chunks=2, steps=2)  # torch's name
    assert schedule.name == "bfs" and schedule.stage_ranks == [[0], [1], [0], [1]]
    check(schedule)
    assert [m.rank_peak_activations for m in memory_by_rank(schedule)] == [10, 10]  # all m on both chunks
    assert simulate(schedule).makespan > 0


def test_refuses_replicas():
    with pytest.raises(ScheduleError, match="replicated"):
        order("bfs", 2, 4, replicas=[2, 1])
