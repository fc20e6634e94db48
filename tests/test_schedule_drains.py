"""Schedules that drain their pipeline after chosen updates (pipetrain.schedule.drains)."""

from __future__ import annotations

import pytest

from pipetrain.schedule.cuts import cut
from pipetrain.schedule import build, check
from pipetrain.schedule.drains import drained
from pipetrain.schedule.ir import Kind


@pytest.mark.parametrize("name, stages, units", [("pipedream", 3, 1), ("pb", 3, 1), ("2bw", 3, 3)])
def test_an_asynchronous_schedule_drained_is_valid_and_empty_at_its_drain(name, stages, units):
    asynchronous = name != "2bw"

    def make(updates):
        if asynchronous:
            return build(name, stages, updates * units, update_every=units, pattern=True)
        return build(name, stages, units, steps=updates, pattern=True)

    schedule = drained(make, 10, [6], units, asynchronous)
    check(schedule)
    first = make(6)
    at = cut(schedule, 6 * units)
    assert at.positions == [len(p) for p in first.programs]  # the end of the 6-update run's programs
    assert at.crossing_sends == [[] for _ in first.programs]
    for rank, program in enumerate(schedule.programs):
        head = list(program)[: len(first.programs[rank])]
        assert head == list(first.programs[rank])
        later = [a for a in list(program)[len(head):] if a.kind is Kind.F]
        assert min(a.microbatch for a in later) == 6 * units and min(a.version for a in later) == 6
    assert [list(p) for p in schedule.programs] != [list(p) for p in make(10).programs]  # not the longer run


def test_a_synchronous_schedule_drained_is_the_longer_schedule_itself():
    def make(updates):
        return build("1f1b", 3, 3, steps=updates, pattern=True)

    schedule = drained(make, 10, [6], 3, asynchronous=False)
    assert [list(p) for p in schedule.programs] == [list(p) for p in make(10).programs]
    assert (schedule.microbatches, schedule.steps) == (3, 10)
