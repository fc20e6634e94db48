"""The validator: every generated schedule passes; seeded errors are caught and named."""

import itertools

import pytest

from pipetrain.errors import DeadlockError, ScheduleError
from pipetrain.schedule import build, check, loads, problems


def _grid():
    for stages in range(1, 17):
        for m in sorted({1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, stages, 2 * stages}):
            yield stages, m


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "pipedream", "pb", "2bw"])
def test_every_generated_schedule_is_valid(name):
    count = 0
    for stages, m in _grid():
        if name == "2bw" and m < stages:
            continue
        kwargs = {"steps": 2} if name in ("gpipe", "1f1b", "zb-h1", "2bw") else {}
        check(build(name, stages, m, **kwargs))
        count += 1
    assert count > 100


def test_every_interleaved_schedule_is_valid():
    for stages, chunks in itertools.product(range(1, 17), range(1, 5)):
        for groups in (1, 2, 3, 4):
            check(build("interleaved", stages, groups * stages, chunks=chunks, steps=2))


@pytest.mark.parametrize("replicas", [[2, 1], [3, 1], [1, 2], [2, 2], [2, 1, 1], [1, 3, 2], [4, 2, 1, 1]])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "2bw"])
def test_replicated_layouts_are_valid(name, replicas):
    from math import lcm

    unit = lcm(*replicas)
    for m in (unit, 2 * unit, 6 * unit):
        if name == "2bw" and m < len(replicas):
            continue
        kwargs = {"steps": 2} if name != "pipedream" else {}
        check(build(name, len(replicas), m, replicas=replicas, **kwargs))


def test_policies_on_asynchronous_orders_are_valid():
    for policy in ("stash", "vsync", "latest", "predict"):
        for stages in (1, 2, 4, 7):
            check(build("pipedream", stages, 20, policy=policy))
            check(build("pb", stages, 20, policy=policy))


GOOD = """
0, 0F0, 0SEND_F0>1, 0F1, 0SEND_F1>1, 0RECV_B0<1, 0B0, 0RECV_B1<1, 0B1, 0STEP
1, 1RECV_F0<0, 1F0, 1B0, 1SEND_B0>0, 1RECV_F1<0, 1F1, 1B1, 1SEND_B1>0, 1STEP
"""


def test_a_hand_written_schedule_passes():
    check(loads(GOOD))


def test_missing_recv_is_named():
    bad = GOOD.replace("1RECV_F1<0, ", "")
    found = problems(loads(bad))
    assert any("1F1" in p and "neither received" in p for p in found)
    assert any("SEND_F of microbatch 1" in p and "0 matching RECV_F" in p for p in found)


def test_backward_before_forward_is_named():
    bad = GOOD.replace("1F0, 1B0,", "1B0, 1F0,")
    found = problems(loads(bad))
    assert any("rank 1" in p and "1B0" in p and "backward before the forward" in p for p in found)


def test_a_version_read_before_it_exists_is_named():
    bad = GOOD.replace("0B1,", "0B1@v1,")
    found = problems(loads(bad))
    assert any("reads version 1" in p for p in found)


def test_cross_rank_wait_cycle_is_found_and_named():
    # rank 0 waits for the gradient of microbatch 0 before sending the input of microbatch 1,
    # while rank 1 waits for that input before sending the gradient.
    text = """
    0, 0F0, 0SEND_F0>1, 0RECV_B0<1, 0B0, 0F1, 0SEND_F1>1, 0RECV_B1<1, 0B1, 0STEP
    1, 1RECV_F0<0, 1F0, 1RECV_F1<0, 1F1, 1B0, 1SEND_B0>0, 1B1, 1SEND_B1>0, 1STEP
    """
    schedule = loads(text)
    assert problems(schedule) == []
    with pytest.raises(DeadlockError) as error:
        check(schedule)
    message = str(error.value)
    assert "rank 0 is stuck at action #2 0RECV_B0<1" in message
    assert "rank 1 is stuck at action #2 1RECV_F1<0" in message
    assert "wait cycle: rank 0 -> rank 1 -> rank 0" in message


def test_sync_waits_for_replicas():
    from dataclasses import replace

    from pipetrain.schedule import dry_run

    schedule = build("1f1b", 2, 4, replicas=[2, 1])
    programs = [list(p) for p in schedule.programs]
    programs[1] = [a for a in programs[1] if a.kind.value != "SYNC"]
    broken = replace(schedule, programs=programs)
    assert any("needs a SYNC before it" in p for p in problems(broken))
    with pytest.raises(DeadlockError, match=r"rank 0 is stuck at .*0SYNC.*replicas on ranks \[1\] to reach SYNC"):
        dry_run(broken)


def test_check_lists_problems_in_one_error():
    with pytest.raises(ScheduleError, match=r"invalid \(\d+ problems\)"):
        check(loads("0, 0B0, 0STEP\n"))
