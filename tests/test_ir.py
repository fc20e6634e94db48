"""The schedule IR: action strings and whole schedules round-trip through text."""

import pytest
from hypothesis import given, strategies as st

from pipetrain.errors import ScheduleError
from pipetrain.schedule import Action, Kind, build, dumps, format_action, loads, parse_action
from pipetrain.schedule.ir import halves, pair


@pytest.mark.parametrize(
    "text, action",
    [
        ("0F3@v1", Action(Kind.F, 0, 3, 1)),
        ("2B3", Action(Kind.B, 2, 3)),
        ("1I4@v2", Action(Kind.I, 1, 4, 2)),
        ("1W4@v2", Action(Kind.W, 1, 4, 2)),
        ("0SEND_F3>1", Action(Kind.SEND_F, 0, 3, None, 1)),
        ("1RECV_F3<0", Action(Kind.RECV_F, 1, 3, None, 0)),
        ("1SEND_B3>0", Action(Kind.SEND_B, 1, 3, None, 0)),
        ("0RECV_B3<1", Action(Kind.RECV_B, 0, 3, None, 1)),
        ("0SYNC", Action(Kind.SYNC, 0)),
        ("12STEP", Action(Kind.STEP, 12)),
    ],
)
def test_action_string_round_trip(text, action):
    assert parse_action(text) == action
    assert format_action(action) == text
    assert str(action) == text


@given(
    kind=st.sampled_from([kind for kind in Kind if kind is not Kind.FB]),
    stage=st.integers(0, 999),
    microbatch=st.integers(0, 10**6),
    version=st.integers(0, 10**6),
    peer=st.integers(0, 999),
)
def test_any_action_round_trips(kind, stage, microbatch, version, peer):
    compute = kind in (Kind.F, Kind.B, Kind.I, Kind.W)
    comm = kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
    action = Action(
        kind,
        stage,
        microbatch if compute or comm else None,
        version if compute else None,
        peer if comm else None,
    )
    assert parse_action(format_action(action)) == action


@given(
    stages=st.tuples(st.integers(0, 999), st.integers(0, 999)),
    microbatches=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
    versions=st.tuples(st.none() | st.integers(0, 10**6), st.none() | st.integers(0, 10**6)),
    backward=st.sampled_from([Kind.B, Kind.I]),
)
def test_any_pair_round_trips(stages, microbatches, versions, backward):
    forward = Action(Kind.F, stages[0], microbatches[0], versions[0])
    other = Action(backward, stages[1], microbatches[1], versions[1])
    action = pair(forward, other)
    assert action.kind is Kind.FB and halves(action) == (forward, other)
    assert parse_action(format_action(action)) == action
    assert parse_action(format_action(action) + "OVERLAP_F_B") == action  # torch's spelling


def test_pair_string_form():
    action = parse_action("(0F7@v0;3B2@v1)")
    assert halves(action) == (Action(Kind.F, 0, 7, 0), Action(Kind.B, 3, 2, 1))
    assert str(action) == "(0F7@v0;3B2@v1)"
    assert [a.kind for a in halves(Action(Kind.W, 1, 2))] == [Kind.W]  # any other action is its own half


@pytest.mark.parametrize("bad", ["(0B7;3F2)", "(0F7;3W2)", "(0F7;3F2)", "(0F7)", "(0F7;3B2;1B1)", "(0STEP;1B1)"])
def test_pairs_are_a_forward_then_a_backward(bad):
    with pytest.raises(ScheduleError, match="forward|expected STAGE KIND|takes no microbatch"):
        parse_action(bad)


@pytest.mark.parametrize(
    "bad, hint",
    [
        ("F3", "expected STAGE KIND"),
        ("0X3", "expected STAGE KIND"),
        ("0F", "needs a microbatch"),
        ("0STEP3", "takes no microbatch"),
        ("0SEND_F3<1", "'>RANK'"),
        ("0F3>1", "only SEND and RECV"),
        ("0SEND_F3@v1>1", "only F, B, I and W"),
    ],
)
def test_malformed_actions_are_refused_with_a_hint(bad, hint):
    with pytest.raises(ScheduleError, match=hint.replace("(", r"\(")):
        parse_action(bad)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("gpipe", dict(steps=2)),
        ("1f1b", dict(replicas=[2, 1, 1])),
        ("interleaved", dict(chunks=2)),
        ("zb-h1", {}),
        ("bfs", dict(chunks=2)),
        ("interleaved-zb", dict(chunks=2)),
        ("dualpipev", dict(steps=2)),
        ("pipedream", dict(replicas=[2, 1, 1])),
        ("2bw", dict(steps=3)),
        ("pb", {}),
    ],
)
def test_schedule_text_round_trip(name, kwargs):
    stages = len(kwargs.get("replicas", [0] * 3))
    schedule = build(name, stages, 6, **kwargs)
    again = loads(dumps(schedule))
    assert again.programs == schedule.programs
    assert again.stage_ranks == schedule.stage_ranks
    assert (again.name, again.policy, again.microbatches, again.steps, again.chunks) == (
        schedule.name, schedule.policy, schedule.microbatches, schedule.steps, schedule.chunks,
    )
    assert dumps(again) == dumps(schedule)


def test_hand_written_schedule_infers_placement_and_microbatches():
    text = """
    # a two-stage schedule written by hand
    0, 0F0, 0SEND_F0>1, 0F1, 0SEND_F1>1, 0RECV_B0<1, 0B0, 0RECV_B1<1, 0B1, 0STEP
    1, 1RECV_F0<0, 1F0, 1B0, 1SEND_B0>0, 1RECV_F1<0, 1F1, 1B1, 1SEND_B1>0, 1STEP
    """
    schedule = loads(text)
    assert schedule.stage_ranks == [[0], [1]]
    assert schedule.microbatches == 2 and schedule.steps == 1
    assert schedule.name == "custom"


def test_loads_names_the_bad_line():
    with pytest.raises(ScheduleError, match="line 2, cell 2: "):
        loads("0,0F0\n1,1Q0\n")
    with pytest.raises(ScheduleError, match="rank"):
        loads("zero,0F0\n")
    with pytest.raises(ScheduleError, match=r"ranks \[1\] have no program"):
        loads("0,0F0\n2,1F0\n")


def test_peer_of_names_the_other_end_of_every_message():
    schedule = build("1f1b", stages=2, microbatches=4, replicas=[2, 1])
    for program in schedule.programs:
        for action in program:
            if action.kind in (Kind.SEND_F, Kind.RECV_B):
                assert schedule.peer_of(action) == schedule.rank_of(action.stage + 1, action.microbatch)
            elif action.kind in (Kind.SEND_B, Kind.RECV_F):
                assert schedule.peer_of(action) == schedule.rank_of(action.stage - 1, action.microbatch)
    named = Action(Kind.SEND_F, 0, 1, None, 2)
    assert schedule.peer_of(named) == 2
