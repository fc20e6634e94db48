"""When receives may be posted on demand: the dry run of on_demand_is_safe."""

from __future__ import annotations

import pytest

from pipetrain.schedule.cuts import cut
from pipetrain.schedule.messages import Messages
from pipetrain.runtime.sends import on_demand_is_safe
from pipetrain.schedule import build, dry_run
from pipetrain.schedule.ir import Action, Kind, Schedule


@pytest.mark.parametrize("name, extra", [
    ("gpipe", {"steps": 2}), ("1f1b", {"steps": 2}), ("zb-h1", {"steps": 2}), ("2bw", {"steps": 2}),
    ("pipedream", {}), ("pb", {}),
])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_usual_schedules_may_receive_on_demand(name, extra, stages):
    assert on_demand_is_safe(build(name, stages=stages, microbatches=8, **extra))


@pytest.mark.parametrize("name, extra", [("1f1b", {"steps": 2}), ("pipedream", {})])
def test_replicated_stages_may_receive_on_demand(name, extra):
    assert on_demand_is_safe(build(name, stages=2, microbatches=8, replicas=[2, 1], **extra))


def test_interleaved_keeps_its_receives_posted_ahead():
    # Each rank sends several messages to the same peer before receiving; one of them waits for a
    # receive that its peer reaches only after a message this rank sends later.
    assert not on_demand_is_safe(build("interleaved", stages=2, microbatches=4, chunks=2))


def _action(kind: Kind, stage: int) -> Action:
    return Action(kind, stage, 0, None, None)


def test_a_send_waited_for_before_the_peer_can_take_it_is_refused():
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Rank 0 sends to stage 1, receives from
    # it, then sends to stage 3; rank 1 takes the stage-3 message before the stage-1 one. Posted
    # ahead this runs; on demand, rank 0 waits at its receive for its first send, which rank 1
    # takes only after the message rank 0 has not sent yet.
    programs = [
        [_action(Kind.SEND_F, 0), _action(Kind.RECV_F, 2), _action(Kind.SEND_F, 2)],
        [_action(Kind.SEND_F, 1), _action(Kind.RECV_F, 3), _action(Kind.RECV_F, 1)],
    ]
    schedule = Schedule(programs, stage_ranks=[[0], [1], [0], [1]])
    dry_run(schedule)  # no deadlock with receives posted ahead
    assert not on_demand_is_safe(schedule)
    programs[1] = [_action(Kind.SEND_F, 1), _action(Kind.RECV_F, 1), _action(Kind.RECV_F, 3)]
    assert on_demand_is_safe(Schedule(programs, stage_ranks=[[0], [1], [0], [1]]))


@pytest.mark.parametrize("name, extra, units", [
    ("1f1b", {"steps": 4}, [8, 16, 24]), ("gpipe", {"steps": 3}, [8, 16]), ("pipedream", {}, [3, 4, 9]),
    ("2bw", {"steps": 3}, [8, 16]), ("pb", {}, [5, 6]),
])
@pytest.mark.parametrize("stages", [2, 3])
def test_runs_that_pause_at_cuts_may_receive_on_demand(name, extra, units, stages):
    # Pipedream's cuts leave activations in flight: their sends cross the pause and are waited
    # for after it; waiting for them before would deadlock, the receiver takes them after its cut.
    schedule = build(name, stages=stages, microbatches=8, **extra)
    messages = Messages(schedule)
    pauses = [cut(schedule, count, messages).positions for count in units]
    assert on_demand_is_safe(schedule, messages, pauses)
    if name == "pipedream":
        assert any(cut(schedule, count, messages).crossing_sends[0] for count in units)


def test_a_pause_that_a_message_must_cross_backwards_is_refused():
    # Rank 1 needs rank 0's message before its pause, but rank 0 sends it only after its own.
    programs = [[_action(Kind.SEND_F, 0)], [_action(Kind.RECV_F, 1)]]
    schedule = Schedule(programs, stage_ranks=[[0], [1]])
    assert on_demand_is_safe(schedule)
    assert not on_demand_is_safe(schedule, pauses=[[0, 1]])
    assert on_demand_is_safe(schedule, pauses=[[1, 1]])
    assert on_demand_is_safe(schedule, pauses=[[1, 0], [1, 1]])  # the send crosses the first pause


@pytest.mark.parametrize("name, extra, resume_at", [("pipedream", {}, 5), ("1f1b", {"steps": 4}, 16)])
def test_a_resumed_run_may_receive_on_demand(name, extra, resume_at):
    # The resumed ranks start at their cut with the messages that crossed it sent again.
    schedule = build(name, stages=3, microbatches=8, **extra)
    messages = Messages(schedule)
    start = cut(schedule, resume_at, messages)
    if name == "pipedream":
        assert any(start.crossing_sends)
    assert on_demand_is_safe(schedule, messages, start=start)
    later = [cut(schedule, resume_at + 1, messages).positions] if name == "pipedream" else []
    assert on_demand_is_safe(schedule, messages, later, start=start)
