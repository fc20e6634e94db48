"""Every named schedule: its order, its versions (docs/design.md section 3) and its parameter checks."""

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedule import Kind, build, check, order, pb_delays, warmup_depths
from pipetrain.schedule.summary import versions_read
from pipetrain.schedule.memory import memory_by_rank


def compute_order(schedule, rank):
    return [str(a) for a in schedule.programs[rank] if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP)]


def test_1f1b_order_warms_up_then_alternates():
    schedule = build("1f1b", 4, 6)
    assert compute_order(schedule, 0) == [
        "0F0@v0", "0F1@v0", "0F2@v0", "0F3@v0", "0B0@v0", "0F4@v0", "0B1@v0", "0F5@v0",
        "0B2@v0", "0B3@v0", "0B4@v0", "0B5@v0", "0STEP",
    ]
    assert compute_order(schedule, 3)[:4] == ["3F0@v0", "3B0@v0", "3F1@v0", "3B1@v0"]


def test_gpipe_runs_all_forwards_first_and_flushes_every_step():
    schedule = build("gpipe", 2, 3, steps=2)
    assert compute_order(schedule, 1) == [
        "1F0@v0", "1F1@v0", "1F2@v0", "1B0@v0", "1B1@v0", "1B2@v0", "1STEP",
        "1F3@v1", "1F4@v1", "1F5@v1", "1B3@v1", "1B4@v1", "1B5@v1", "1STEP",
    ]


def test_pipedream_versions_reproduce_the_design_table():
    table = {
        0: [0, 0, 0, 0, 1, 2, 3, 4],
        1: [0, 0, 0, 1, 2, 3, 4, 5],
        2: [0, 0, 1, 2, 3, 4, 5, 6],
        3: [0, 1, 2, 3, 4, 5, 6, 7],
    }
    schedule = build("pipedream", 4, 8)
    versions = versions_read(schedule)
    for stage, expected in table.items():
        assert [v[0] for v in versions[stage]] == expected
        assert [v[1] for v in versions[stage]] == expected  # backward reuses the stashed version
    assert warmup_depths([1, 1, 1, 1]) == [3, 2, 1, 0]


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
def test_pipedream_versions_follow_the_closed_form(stages):
    units = 3 * stages + 2
    versions = versions_read(build("pipedream", stages, units))
    for s, depth in enumerate(warmup_depths([1] * stages)):
        assert [v[0] for v in versions[s]] == [max(0, k - depth) for k in range(units)]


def test_pipedream_keeps_warmup_plus_one_versions_and_activations():
    memory = memory_by_rank(build("pipedream", 4, 12))
    for stage, depth in enumerate([3, 2, 1, 0]):
        assert memory[stage].peak_versions[stage] == depth + 1
        assert memory[stage].peak_activations[stage] == depth + 1


def test_noam_and_replicated_routing():
    assert warmup_depths([2, 1]) == [1, 0]          # N = 3: NOAM = ceil(3/2) = 2 per replica
    assert warmup_depths([3, 1]) == [1, 0]
    assert warmup_depths([1, 1, 1]) == [2, 1, 0]
    schedule = build("pipedream", 2, 8, replicas=[2, 1])
    check(schedule)
    assert schedule.stage_ranks == [[0, 1], [2]]
    assert {a.microbatch for a in schedule.programs[0] if a.kind is Kind.F} == {0, 2, 4, 6}
    assert {a.microbatch for a in schedule.programs[1] if a.kind is Kind.F} == {1, 3, 5, 7}
    # replicas average their gradients before every update
    kinds = [a.kind for a in schedule.programs[0] if a.kind in (Kind.SYNC, Kind.STEP)]
    assert kinds == [Kind.SYNC, Kind.STEP] * 4


def test_vsync_uses_stage_zero_versions_everywhere():
    schedule = build("pipedream", 4, 10, policy="vsync")
    check(schedule)
    versions = versions_read(schedule)
    for stage in range(4):
        assert [list(v) for v in versions[stage]] == [[max(0, k - 3)] * 2 for k in range(10)]


def test_pb_delays_versions_and_samples_in_flight():
    assert pb_delays(5) == [8, 6, 4, 2, 0]
    schedule = build("pb", 5, 30)
    versions = versions_read(schedule)
    for stage, delay in enumerate(pb_delays(5)):
        assert [v[0] for v in versions[stage]] == [max(0, n - delay) for n in range(30)]
        assert [v[1] for v in versions[stage]] == list(range(30))  # latest: current weights
    memory = memory_by_rank(schedule)
    assert [memory[s].peak_activations[s] for s in range(5)] == [9, 7, 5, 3, 1]
    # no stashing under latest: one version alive at a time... but forwards read older ones
    stash = build("pb", 5, 30, policy="stash")
    check(stash)
    assert [v[1] for v in versions_read(stash)[0]] == [max(0, n - 8) for n in range(30)]


def test_pb_tick_order():
    """Stage s runs F(t - s) then B(t - (2S-2-s)) in tick t."""
    stages, samples = 3, 6
    schedule = build("pb", stages, samples, communication=False)
    for s in range(stages):
        expected = []
        for t in range(samples + 2 * stages):
            f, b = t - s, t - (2 * stages - 2 - s)
            if 0 <= f < samples:
                expected.append(f"F{f}")
            if 0 <= b < samples:
                expected += [f"B{b}", "STEP"]
        got = [a.kind.value + ("" if a.microbatch is None else str(a.microbatch)) for a in schedule.programs[s]]
        assert got == expected


def test_2bw_reads_version_t_minus_one_and_keeps_two_versions():
    stages, m, steps = 4, 4, 5
    schedule = build("2bw", stages, m, steps=steps)
    check(schedule)
    versions = versions_read(schedule)
    for stage in range(stages):
        for k in range(m * steps):
            assert list(versions[stage][k]) == [max(0, k // m - 1)] * 2
    memory = memory_by_rank(schedule)
    assert all(max(mem.peak_versions.values()) <= 2 for mem in memory)
    assert max(memory[0].peak_versions.values()) == 2
    # one update per batch
    assert sum(1 for a in schedule.programs[0] if a.kind is Kind.STEP) == steps


def test_peak_activations_of_synchronous_schedules():
    for stages, m in [(4, 8), (4, 2), (6, 3)]:
        gpipe = memory_by_rank(build("gpipe", stages, m))
        ofob = memory_by_rank(build("1f1b", stages, m))
        zb = memory_by_rank(build("zb-h1", stages, m))
        for s in range(stages):
            assert gpipe[s].peak_activations[s] == m
            assert ofob[s].peak_activations[s] == min(stages - s, m)
            assert zb[s].peak_activations[s] == min(stages - s, m)


def test_interleaved_places_chunks_round_robin():
    schedule = build("interleaved", 2, 4, chunks=2)
    assert schedule.stage_ranks == [[0], [1], [0], [1]]
    forwards = [(a.stage, a.microbatch) for a in schedule.programs[0] if a.kind is Kind.F]
    assert forwards == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("2bw", dict(stages=4, microbatches=3), r"m >= S.*microbatches=4 or more"),
        ("interleaved", dict(stages=4, microbatches=6, chunks=2), r"multiple of stages \(4\).*microbatches=4 or microbatches=8"),
        ("1f1b", dict(stages=2, microbatches=8, replicas=[2, 1, 1]), "one count per stage"),
        ("pipedream", dict(stages=2, microbatches=7, replicas=[2, 1]), "microbatches=8"),
        ("1f1b", dict(stages=2, microbatches=3, replicas=[2, 1]), "microbatches=4"),
        ("pb", dict(stages=2, microbatches=4, replicas=[2, 1]), "drop replicas"),
        ("zb-h1", dict(stages=2, microbatches=4, replicas=[2, 1]), "does not support replicated"),
        ("gpipe", dict(stages=0, microbatches=4), "stages must be a positive integer"),
        ("gpipe", dict(stages=2, microbatches=4, chunks=2), "looped schedules .* only"),
        ("pipedream", dict(stages=2, microbatches=4, steps=2), "drop steps"),
        ("pipedrem", dict(stages=2, microbatches=4), "did you mean pipedream"),
    ],
)
def test_impossible_parameters_are_refused_with_what_works(name, kwargs, message):
    stages = kwargs.pop("stages")
    microbatches = kwargs.pop("microbatches")
    with pytest.raises(ScheduleError, match=message):
        build(name, stages, microbatches, **kwargs)


def test_order_and_policy_are_independent():
    base = order("pipedream", 3, 9)
    stash = build("pipedream", 3, 9)
    latest = build("pipedream", 3, 9, policy="latest")
    strip = lambda s: [[(a.kind, a.stage, a.microbatch) for a in p] for p in s.programs]  # noqa: E731
    assert strip(stash) == strip(latest)
    assert [a.version for a in base.programs[0]] == [None] * len(base.programs[0])
    assert versions_read(latest)[0][5] == (3, 5)
    assert versions_read(stash)[0][5] == (3, 3)
