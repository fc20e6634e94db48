"""When receives may be posted on demand: the dry run of on_demand_is_safe, and auto's choice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipetrain.schedule.cuts import cut
from pipetrain.schedule.messages import Messages
from pipetrain.runtime.sends import on_demand_is_safe, splits_backward
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


@pytest.mark.parametrize("name, extra, split", [
    ("1f1b", {"steps": 2}, False), ("gpipe", {"steps": 2}, False), ("pipedream", {}, False),
    ("zb-h1", {"steps": 2}, True), ("zb-h2", {"steps": 2}, True),
    ("interleaved-zb", {"steps": 2, "chunks": 2, "microbatches": 4}, True),
    ("zb-h1", {"steps": 400, "pattern": True}, True),  # a long run's pattern: its sample is read
])
def test_a_split_backward_is_found_in_the_programs(name, extra, split):
    schedule = build(name, stages=2, **{"microbatches": 8, **extra})
    assert splits_backward(schedule) is split


def test_auto_posts_a_split_backwards_receives_ahead_and_1f1bs_on_demand(tmp_path):
    for schedule, expected in (("zb-h1", "ahead"), ("1f1b", "on-demand")):
        report = tmp_path / f"{schedule}.json"
        done = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "--schedule", schedule, "--stages", "2",
                               "--steps", "2", "--microbatches", "4", "--report-json", str(report), "--quiet",
                               "--no-progress", "--eval-samples", "16"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr
        assert json.loads(report.read_text())["receives"] == [expected] * 2


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


class _Handle:
    """A send handle that records that it was waited for."""

    def __init__(self, name: str, waited: list) -> None:
        self.name, self.waited = name, waited

    def wait(self) -> None:
        self.waited.append(self.name)


def _waits_after_each_receive(name: str, rank: int = 0) -> list[tuple[str, list[str]]]:
    """Rank ``rank``'s program run through a SendLedger with receives on demand: after each RECV,
    the sends it waits for."""
    from pipetrain.runtime.sends import SendLedger

    schedule = build(name, stages=2, microbatches=8)
    ledger = SendLedger(schedule, rank)
    peer = 1 - rank
    waited: list[str] = []
    after = []
    for position, action in enumerate(schedule.programs[rank]):
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            ledger.sent(position, peer, _Handle(f"{action.kind.value}{action.microbatch}", waited))
        elif action.kind in (Kind.RECV_F, Kind.RECV_B):
            waited.clear()
            ledger.received_on_demand(position, peer)
            after.append((f"{action.kind.value}{action.microbatch}", list(waited)))
    return after


def test_on_demand_a_rank_waits_only_for_the_sends_its_peer_takes_before_its_next_message():
    # 1f1b: after receiving B(k), rank 0's open send F(k+1) is the peer's next receive: waited for
    assert _waits_after_each_receive("1f1b")[:3] == [("RECV_B0", ["SEND_F0", "SEND_F1"]), ("RECV_B1", ["SEND_F2"]),
                                                     ("RECV_B2", ["SEND_F3"])]
    # zb-h2 sends two forwards ahead: waiting for F(k+2) after B(k) would hold rank 0 until the peer
    # reaches it, lock-step; F(k+1), which the peer takes before it sends B(k+1), is waited for
    assert _waits_after_each_receive("zb-h2")[:3] == [("RECV_B0", ["SEND_F0", "SEND_F1"]), ("RECV_B1", ["SEND_F2"]),
                                                      ("RECV_B2", ["SEND_F3"])]
