"""Consistent cuts of schedules (where ranks checkpoint or pause to evaluate)."""

import pytest

from pipetrain.errors import ConfigError
from pipetrain.schedule.cuts import cut, cuts, in_flight, shared_updates
from pipetrain.schedule import Kind, build, loads


def before(schedule, rank, position):
    return schedule.programs[rank][:position]


def test_flush_schedules_cut_at_step_boundaries_with_nothing_crossing():
    schedule = build("1f1b", 3, 4, steps=3)
    c = cut(schedule, 8)  # after two steps
    for rank in range(3):
        done = before(schedule, rank, c.positions[rank])
        assert sum(1 for a in done if a.kind is Kind.STEP) == 2
        assert all(a.microbatch is None or a.microbatch < 8 for a in done)
    assert c.crossing_sends == [[], [], []]


def test_pipedream_cuts_leave_forwards_in_flight_and_name_crossing_sends():
    schedule = build("pipedream", 3, 12)
    c = cut(schedule, 5)
    for rank, depth in enumerate([2, 1, 0]):
        done = before(schedule, rank, c.positions[rank])
        assert sum(1 for a in done if a.kind is Kind.STEP) == 5
        forwards = [a.microbatch for a in done if a.kind is Kind.F]
        assert forwards == list(range(5 + depth))  # W_s microbatches still in flight
    # stage 0 has sent F(5), F(6): stage 1 received F(5) before its cut, F(6) comes after it;
    # stage 1 has sent F(5), which stage 2 receives after its cut
    assert [str(schedule.programs[0][p]) for p in c.crossing_sends[0]] == ["0SEND_F6>1"]
    assert [str(schedule.programs[1][p]) for p in c.crossing_sends[1]] == ["1SEND_F5>2"]


def test_the_forwards_in_flight_at_a_cut_and_the_versions_they_read():
    schedule = build("pb", 3, 20)  # latest policy: each forward's version is released once it is done
    positions = [c.positions[0] for c in cuts(schedule, [6, 11])]
    flying = in_flight(schedule.programs[0], positions)
    for position, forwards in zip(positions, flying):
        done = before(schedule, 0, position)
        backwards = {a.microbatch for a in done if a.kind is Kind.B}
        assert [a.microbatch for a in forwards] == [a.microbatch for a in done if a.kind is Kind.F
                                                    and a.microbatch not in backwards]
        assert len(forwards) == 4  # right after a backward, D_0 = 2(S - 1) samples are in flight at stage 0
        assert len({a.version for a in forwards}) == 4  # each read its own version: a checkpoint needs them all
    assert in_flight(schedule.programs[0], [0, len(schedule.programs[0])]) == [[], []]


def test_cut_inside_a_split_backward_is_refused():
    schedule = loads("0, 0F0, 0F1, 0I0, 0I1, 0W0, 0W1, 0STEP")
    with pytest.raises(ConfigError, match="I but not the W"):
        cut(schedule, 1)


def test_inconsistent_cut_is_refused():
    schedule = loads("""
    0, 0F0, 0SEND_F0>1, 0F1, 0SEND_F1>1, 0RECV_B0<1, 0B0, 0RECV_B1<1, 0B1, 0STEP
    1, 1RECV_F0<0, 1F0, 1B0, 1RECV_F1<0, 1F1, 1B1, 1SEND_B1>0, 1SEND_B0>0, 1STEP
    """)
    with pytest.raises(ConfigError, match="before its cut"):
        cut(schedule, 1)


def test_a_stop_inside_an_update_that_replicas_share_is_refused():
    # Stage 0 has two replicas: minibatches 0 and 1 make one update together, 2 and 3 the next.
    schedule = build("pipedream", 2, 8, replicas=[2, 1])
    assert shared_updates(schedule) == [(0, 0, 1), (0, 2, 3), (0, 4, 5), (0, 6, 7)]
    assert shared_updates(build("pipedream", 3, 8)) == []
    for units in (2, 4, 6):
        cut(schedule, units)
    with pytest.raises(ConfigError, match="replicas of stage 0 update together over units 2..3"):
        cut(schedule, 3)


@pytest.mark.parametrize("name, options", [
    ("pipedream", dict(stages=3, microbatches=12)), ("pipedream", dict(stages=3, microbatches=12, replicas=[1, 2, 1])),
    ("1f1b", dict(stages=3, microbatches=4, steps=3)), ("zb-h1", dict(stages=3, microbatches=4, steps=3)),
    ("2bw", dict(stages=3, microbatches=3, steps=4)), ("pb", dict(stages=4, microbatches=10)),
    ("interleaved", dict(stages=2, microbatches=4, steps=3, chunks=2)),
])
def test_all_cuts_in_one_pass_equal_each_cut_alone(name, options):
    schedule = build(name, **options)
    total = 1 + max(a.microbatch for program in schedule.programs for a in program if a.microbatch is not None)
    alone, refused = {}, {}
    for units in range(total + 1):
        try:
            alone[units] = cut(schedule, units)
        except ConfigError as error:
            refused[units] = str(error)
    together = cuts(schedule, list(alone))
    assert [(c.units, c.positions, c.crossing_sends) for c in together] == [
        (c.units, c.positions, c.crossing_sends) for c in alone.values()
    ]
    for units, message in refused.items():  # one refused count among good ones: its own error
        with pytest.raises(ConfigError) as error:
            cuts(schedule, [*alone, units])
        assert str(error.value) == message


FEED_CASES = [
    ("gpipe", dict(stages=3, microbatches=4, steps=3), 4),
    ("1f1b", dict(stages=4, microbatches=4, steps=3), 4),
    ("zb-h1", dict(stages=3, microbatches=3, steps=2), 3),
    ("interleaved", dict(stages=2, microbatches=4, steps=2, chunks=2), 4),
    ("pipedream", dict(stages=4, microbatches=9), 1),
    ("pipedream", dict(stages=2, microbatches=8, replicas=[2, 1]), 1),
    ("pipedream", dict(stages=3, microbatches=8, update_every=2), 2),
    ("2bw", dict(stages=3, microbatches=3, steps=3), 3),
    ("pb", dict(stages=4, microbatches=10), 1),
]


@pytest.mark.parametrize("name, options, per_update", FEED_CASES)
def test_feed_cuts_run_each_rank_as_far_as_the_fed_batches_allow(name, options, per_update):
    from pipetrain.schedule.cuts import feed_cuts
    from pipetrain.schedule.messages import Messages

    options = dict(options)
    stages, units = options.pop("stages"), options.pop("microbatches")
    schedule = build(name, stages, units, **options)
    pieces = feed_cuts(schedule, per_update)
    messages = Messages(schedule)
    total = max(a.microbatch for p in schedule.programs for a in p if a.microbatch is not None) + 1
    assert len(pieces) == -(-total // per_update)
    assert pieces[-1] == [len(p) for p in schedule.programs]  # the last call drains
    for update, piece in enumerate(pieces):
        fed = (update + 1) * per_update
        for rank, program in enumerate(schedule.programs):
            if update:
                assert piece[rank] >= pieces[update - 1][rank]
            done = program[: piece[rank]]
            assert all(a.microbatch < fed for a in done if a.kind is Kind.F and a.stage == 0)
            if piece[rank] < len(program):  # stopped: the next action waits for a later batch or message
                action = program[piece[rank]]
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    sender, position = messages.sent_at[Messages.of(action)]
                    assert piece[sender] <= position
                elif action.kind is Kind.F and action.stage == 0:
                    assert action.microbatch >= fed
                else:
                    assert action.kind is Kind.SYNC
            for action in done:  # consistent: every receive's send came before
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    sender, sent = messages.sent_at[Messages.of(action)]
                    assert sent < piece[sender]


def test_pipedream_feed_cuts_keep_the_warm_up_in_flight():
    from pipetrain.schedule.cuts import feed_cuts

    schedule = build("pipedream", 3, 8)
    pieces = feed_cuts(schedule, 1)
    for update in range(len(pieces) - 1):
        for rank in range(3):
            done = schedule.programs[rank][: pieces[update][rank]]
            forwards = sum(a.kind is Kind.F for a in done)
            backwards = sum(a.kind is Kind.B for a in done)
            assert forwards == update + 1  # every stage has run the forward of each fed minibatch
            assert forwards - backwards == min(update + 1, 2 - rank)  # W_s = 2 - s minibatches in flight
