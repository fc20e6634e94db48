"""Long schedules run from their steady-state pattern (pipetrain.schedule.pattern): the expanded
programs equal the whole build action for action, and everything the executors read off the
programs (messages, version releases, cuts, forwards in flight, feed pieces, the on-demand dry run,
delays) is the same, for every schedule; the pattern does not grow with the run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipetrain.errors import ConfigError
from pipetrain.execution.version_store import version_release_points
from pipetrain.schedule.cuts import cuts, feed_cuts, in_flight
from pipetrain.schedule.messages import Messages
from pipetrain.runtime.sends import on_demand_is_safe
from pipetrain.schedule import build, check, memory_by_rank, staleness, units_per_update
from pipetrain.schedule.pattern import PeriodicProgram, pattern_of

CASES = {
    "pipedream": ("pipedream", 2, 200, {}),
    "pipedream-3": ("pipedream", 3, 301, {}),
    "pipedream-replicated": ("pipedream", 3, 300, dict(replicas=[2, 1, 1])),
    "pipedream-update-every": ("pipedream", 2, 203, dict(update_every=4)),
    "pipedream-vsync": ("pipedream", 2, 200, dict(policy="vsync")),
    "pb": ("pb", 3, 200, {}),
    "pb-update-every": ("pb", 3, 201, dict(update_every=2)),
    "pb-predict": ("pb", 3, 200, dict(policy="predict")),
    "2bw": ("2bw", 3, 4, dict(steps=30)),
    "1f1b": ("1f1b", 3, 4, dict(steps=20)),
    "1f1b-one-microbatch": ("1f1b", 2, 1, dict(steps=30)),
    "1f1b-replicated": ("1f1b", 3, 4, dict(steps=20, replicas=[2, 1, 1])),
    "gpipe": ("gpipe", 2, 3, dict(steps=20)),
    "zb-h1": ("zb-h1", 3, 4, dict(steps=20)),
    "interleaved": ("interleaved", 2, 4, dict(steps=20, chunks=2)),
    "zb-h2": ("zb-h2", 3, 5, dict(steps=20)),
    "zb-v": ("zb-v", 2, 3, dict(steps=20)),
    "v-min": ("v-min", 3, 5, dict(steps=20)),
    "zb-auto": ("zb-auto", 3, 6, dict(steps=20)),
}


@pytest.fixture(autouse=True)
def short_patterns(monkeypatch):
    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", "7")


def _units_per_update(name: str, microbatches: int, options: dict) -> int:
    return options.get("update_every", 1) if name in ("pipedream", "pb") else microbatches


def _same(whole, long, per_update: int) -> None:
    assert pattern_of(long) is not None and pattern_of(whole) is None
    assert [list(p) for p in long.programs] == whole.programs
    assert (long.microbatches, long.steps, long.stage_ranks, long.policy, long.name, long.chunks) == (
        whole.microbatches, whole.steps, whole.stage_ranks, whole.policy, whole.name, whole.chunks)
    check(long)
    assert staleness(long) == staleness(whole)
    assert memory_by_rank(long) == memory_by_rank(whole)
    assert memory_by_rank(long, recompute=True) == memory_by_rank(whole, recompute=True)
    assert units_per_update(long) == units_per_update(whole)
    messages, shifted = Messages(whole), Messages(long)
    assert all(shifted.sent_at[m] == at for m, at in messages.sent_at.items())
    assert all(shifted.received_at[m] == at for m, at in messages.received_at.items())
    for program, expanded in zip(whole.programs, long.programs):
        table, read = version_release_points(program), version_release_points(expanded)
        assert all(table.get(p) == read.get(p) for p in range(len(program) + 1))
    counts = list(range(0, whole.total_microbatches + 1, per_update))
    try:
        expected_cuts = cuts(whole, counts)
    except ConfigError:  # some counts cannot be cut (replicas updating together): compare a few one by one
        expected_cuts = []
        for units in counts[:: max(1, len(counts) // 12)]:
            try:
                expected_cuts.append(cuts(whole, [units])[0])
            except ConfigError:
                with pytest.raises(ConfigError):
                    cuts(long, [units])
    got_cuts = cuts(long, [c.units for c in expected_cuts])
    for expected, got in zip(expected_cuts, got_cuts):
        assert (got.units, got.positions, got.crossing_sends) == (expected.units, expected.positions,
                                                                  expected.crossing_sends)
    for rank in range(whole.num_ranks):
        at = [c.positions[rank] for c in expected_cuts]
        assert in_flight(long.programs[rank], at) == in_flight(whole.programs[rank], at)
    pieces, shifted_pieces = feed_cuts(whole, per_update), feed_cuts(long, per_update)
    assert len(shifted_pieces) == len(pieces) and list(shifted_pieces) == pieces
    assert list(shifted_pieces[:-1]) == pieces[:-1]
    assert on_demand_is_safe(long) == on_demand_is_safe(whole)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pattern_expands_to_the_whole_schedule_and_reads_the_same(case):
    name, stages, microbatches, options = CASES[case]
    whole = build(name, stages, microbatches, **options)
    long = build(name, stages, microbatches, pattern=True, **options)
    _same(whole, long, _units_per_update(name, microbatches, options))


@st.composite
def long_schedules(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved", "pipedream", "2bw", "pb"]))
    stages = draw(st.integers(1, 4))
    options: dict = {}
    if name in ("pipedream", "pb"):
        if draw(st.booleans()):
            options["update_every"] = draw(st.integers(1, 3))
        microbatches = draw(st.integers(7 * 16 * stages, 9 * 16 * stages))
        if name == "pipedream" and draw(st.booleans()):
            options["replicas"] = [draw(st.integers(1, 2)) for _ in range(stages)]
            microbatches -= microbatches % 2
    else:
        options["steps"] = draw(st.integers(7, 12))
        microbatches = draw(st.integers(max(stages, 1), stages + 3))
        if name == "interleaved":
            options["chunks"] = draw(st.integers(1, 2))
            microbatches = stages * draw(st.integers(1, 2))
        if name == "1f1b" and draw(st.booleans()):
            options["replicas"] = [draw(st.integers(1, 2)) for _ in range(stages)]
            microbatches = 2 * draw(st.integers(1, 2))
    return name, stages, microbatches, options


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(long_schedules())
def test_random_long_schedules_expand_and_read_the_same(case):
    name, stages, microbatches, options = case
    whole = build(name, stages, microbatches, **options)
    long = build(name, stages, microbatches, pattern=True, **options)
    if pattern_of(long) is None:  # too short for a pattern: built whole, nothing to compare
        assert [list(p) for p in long.programs] == whole.programs
        return
    _same(whole, long, _units_per_update(name, microbatches, options))


def test_the_pattern_does_not_grow_with_the_run(monkeypatch):
    monkeypatch.delenv("PIPETRAIN_PATTERN_MIN_COPIES")
    short = build("pipedream", 2, 10_000, pattern=True)
    long = build("pipedream", 2, 1_000_000, pattern=True)
    for a, b in zip(short.programs, long.programs):
        assert isinstance(b, PeriodicProgram)
        assert (len(a.head), len(a.body), len(a.tail)) == (len(b.head), len(b.body), len(b.tail))
    assert long.total_microbatches == 1_000_000
    assert [len(p) for p in long.programs] == [5 * 1_000_000] * 2  # F, B, STEP, a SEND and a RECV per unit
    assert str(long.programs[1][5 * 999_999]) == "1RECV_F999999<0"
    assert str(long.programs[0][-1]) == "0STEP"


def test_the_counts_a_replicated_update_splits_are_read_off_the_pattern():
    from pipetrain.schedule.cuts import shared_updates, split_counts

    whole = build("pipedream", 3, 300, replicas=[2, 1, 1])
    long = build("pipedream", 3, 300, replicas=[2, 1, 1], pattern=True)
    expected = {c for _, first, last in shared_updates(whole) for c in range(first + 1, last + 1)}
    assert expected and {c for c in range(301) if c in split_counts(long)} == expected
