"""The timeline simulator pinned to docs/design.md section 3's numbers."""

import pytest

from pipetrain.schedule import Costs, build, simulate
from pipetrain.schedule.summary import summarize


def test_reference_1f1b_s4_m8():
    timeline = simulate(build("1f1b", 4, 8), Costs(F=1, B=2))
    assert timeline.makespan == 33
    summary = summarize(timeline)
    assert summary["bubble_fraction"] == pytest.approx(9 / 33)  # 27.3 %
    assert summary["bubble_fraction_megatron"] == pytest.approx(3 / 8)
    assert [s["busy"] for s in summary["stages"]] == [24] * 4


@pytest.mark.parametrize("m, efficiency", [(4, 0.571), (8, 0.727), (16, 0.842), (32, 0.914)])
def test_efficiency_m_over_m_plus_s_minus_1(m, efficiency):
    for name in ("gpipe", "1f1b"):
        summary = summarize(simulate(build(name, 4, m), Costs(F=1, B=2)))
        assert 1 - summary["bubble_fraction"] == pytest.approx(efficiency, abs=5e-4)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_bubble_formula_gpipe_and_1f1b(stages, m):
    for name in ("gpipe", "1f1b"):
        summary = summarize(simulate(build(name, stages, m), Costs(F=1, B=2)))
        assert summary["makespan"] == pytest.approx((m + stages - 1) * 3)
        assert summary["bubble_fraction"] == pytest.approx((stages - 1) / (m + stages - 1))
        assert summary["bubble_fraction_megatron"] == pytest.approx((stages - 1) / m)


@pytest.mark.parametrize("stages, chunks", [(2, 2), (4, 2), (4, 3), (4, 4), (3, 2), (8, 2)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_bubble_formula_interleaved(stages, chunks, groups):
    m = groups * stages
    summary = summarize(simulate(build("interleaved", stages, m, chunks=chunks), Costs(F=1, B=2)))
    assert summary["bubble_fraction"] == pytest.approx((stages - 1) / (chunks * m + stages - 1))


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (1, 2, 1), (2, 2, 1)])
def test_zb_h1_makespan(stages, extra, f, b, w):
    m = stages + extra
    timeline = simulate(build("zb-h1", stages, m), Costs(F=f, B=b, W=w))
    assert timeline.makespan == pytest.approx(m * (f + b + w) + (stages - 1) * (f + b - w))
    one_f_one_b = simulate(build("1f1b", stages, m), Costs(F=f, B=b, W=w)).makespan
    ratio = (f + b - w) / (f + b + w)
    bubble_1f1b = (one_f_one_b - m * (f + b + w))
    assert timeline.makespan - m * (f + b + w) == pytest.approx(bubble_1f1b * ratio)


def test_pipedream_400_minibatches():
    uniform = simulate(build("pipedream", 4, 400), Costs(F=1, B=2))
    assert uniform.makespan / 400 == pytest.approx(3.0225)
    skewed = simulate(build("pipedream", 4, 400), Costs(F=[1, 1, 2, 1], B=[2, 2, 4, 2]))
    assert skewed.makespan / 400 == pytest.approx(6.018, abs=5e-4)


def test_communication_costs_delay_receivers():
    fast = simulate(build("1f1b", 2, 4), Costs(F=1, B=2)).makespan
    slow = simulate(build("1f1b", 2, 4), Costs(F=1, B=2, latency=0.5)).makespan
    assert slow > fast
    by_bytes = simulate(build("1f1b", 2, 4), Costs(F=1, B=2, bytes=1e6, bandwidth=2e6)).makespan
    assert by_bytes == pytest.approx(slow)


def test_sync_cost_is_charged_to_replicated_stages():
    plain = simulate(build("pipedream", 2, 8, replicas=[2, 1]), Costs(F=1, B=2)).makespan
    costly = simulate(build("pipedream", 2, 8, replicas=[2, 1]), Costs(F=1, B=2, sync=[1, 0])).makespan
    assert costly > plain


def test_times_are_consistent():
    schedule = build("1f1b", 3, 5, steps=2)
    timeline = simulate(schedule, Costs(F=1, B=2, latency=0.25, send=0.1))
    ends = {}
    for rank in range(schedule.num_ranks):
        previous = 0.0
        for action, start, end in timeline.spans(rank):
            assert start >= previous - 1e-12 and end >= start  # one action at a time, in order
            previous = end
            ends[(rank, str(action))] = end
    for rank in range(schedule.num_ranks):
        for action, _, end in timeline.spans(rank):
            if action.kind.value == "RECV_F":
                sent = ends[(action.peer, f"{action.stage - 1}SEND_F{action.microbatch}>{rank}")]
                assert end >= sent + 0.25 - 1e-12
