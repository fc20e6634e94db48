"""DualPipeV: torch's order, the V placement, and its pairs."""

import pytest
from torch_orders import compute_order, torch_order

from pipetrain.errors import ScheduleError
from pipetrain.schedule import Costs, Kind, build, check, memory_by_rank, order, simulate
from pipetrain.schedule.vshape import v_placement


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 3, 6])
def test_order_is_torchs(ranks, extra):
    microbatches = 2 * ranks + extra
    schedule = order("dualpipev", ranks, microbatches)
    assert compute_order(schedule) == torch_order("ScheduleDualPipeV", ranks, 2, microbatches)


def test_v_placement_and_pairs():
    schedule = build("DualPipeV", 3, 8, steps=2)
    check(schedule)
    assert v_placement(3) == [0, 1, 2, 2, 1, 0]
    assert schedule.chunks == 2 and schedule.stage_ranks == [[r] for r in v_placement(3)]
    pairs = [a for program in schedule.programs for a in program if a.kind is Kind.FB]
    assert pairs and all(a.version == a.peer.version for a in pairs)
    assert all(a.stage != a.peer.stage for a in pairs)  # the forward on one of a rank's stages, backward on the other
    timeline = simulate(schedule, Costs(F=[1] * 6, B=[2] * 6))  # per stage (one number would be per rank)
    spans = [(a, end - start) for rank in range(3) for a, start, end in timeline.spans(rank) if a.kind is Kind.FB]
    assert all(length == 3 for _, length in spans)  # on a CPU the halves run one after the other
    assert max(m.rank_peak_activations for m in memory_by_rank(schedule)) <= 2 * 3 + 1


def test_needs_two_microbatches_per_rank():
    with pytest.raises(ScheduleError, match="microbatches=6 or more"):
        order("dualpipev", 3, 5)
    with pytest.raises(ScheduleError, match="always holds 2 chunks"):
        order("dualpipev", 3, 6, chunks=3)
