"""Property tests over random schedule parameters: structure, validity and simulated times."""

from hypothesis import HealthCheck, given, settings, strategies as st

from pipetrain.schedule import Costs, Kind, build, check, simulate

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw", "pb", "zb-h2", "zb-v",
                                 "v-half", "v-min", "zb-auto"]))
    stages = draw(st.integers(1, 6))
    kwargs = {}
    if name in ("zb-v", "v-half", "v-min"):
        m = draw(st.integers(2 * stages - 1, 2 * stages + 4))
    elif name == "interleaved":
        kwargs["chunks"] = draw(st.integers(1, 3))
        m = stages * draw(st.integers(1, 3))
    elif name == "2bw":
        m = draw(st.integers(stages, stages + 4))
    else:
        m = draw(st.integers(1, 9))
    if name in ("gpipe", "1f1b", "interleaved", "zb-h1", "2bw", "zb-h2", "zb-v", "v-half", "v-min", "zb-auto"):
        kwargs["steps"] = draw(st.integers(1, 3))
    if name in ("gpipe", "1f1b", "pipedream") and draw(st.booleans()):
        replicas = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
        from math import lcm

        m = lcm(*replicas) * draw(st.integers(1, 3))
        kwargs["replicas"] = replicas
    return build(name, stages, m, **kwargs)


@SETTINGS
@given(schedules())
def test_each_microbatch_runs_forward_and_backward_once_per_stage(schedule):
    check(schedule)
    counts = {}
    for program in schedule.programs:
        for action in program:
            if action.kind in (Kind.F, Kind.B, Kind.I, Kind.W):
                key = (action.kind, action.stage, action.microbatch)
                counts[key] = counts.get(key, 0) + 1
    total = schedule.total_microbatches
    for stage in range(schedule.num_stages):
        for k in range(total):
            assert counts.get((Kind.F, stage, k)) == 1
            backward = counts.get((Kind.B, stage, k), 0) + counts.get((Kind.I, stage, k), 0)
            assert backward == 1
            if (Kind.I, stage, k) in counts:
                assert counts.get((Kind.W, stage, k)) == 1
    # synchronous schedules update once per step per stage replica
    if schedule.policy == "flush":
        for rank, stages in enumerate(schedule.rank_stages()):
            steps = sum(1 for a in schedule.programs[rank] if a.kind is Kind.STEP)
            assert steps == schedule.steps * len(stages)


@SETTINGS
@given(schedules(), st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0, 1), st.floats(0, 0.5))
def test_simulated_times_respect_order_and_dependencies(schedule, f, b, w, latency):
    timeline = simulate(schedule, Costs(F=f, B=b, W=w, latency=latency))
    end_of = {}
    for rank in range(schedule.num_ranks):
        previous = 0.0
        for action, start, end in timeline.spans(rank):
            assert start >= previous - 1e-9, "a rank ran two actions at once"
            assert end >= start
            previous = end
            end_of[(action.kind, action.stage, action.microbatch)] = end
    for rank in range(schedule.num_ranks):
        for action, start, end in timeline.spans(rank):
            k, s = action.microbatch, action.stage
            if action.kind is Kind.RECV_F:
                assert end >= end_of[(Kind.SEND_F, s - 1, k)] + latency - 1e-9
            if action.kind is Kind.RECV_B:
                assert end >= end_of[(Kind.SEND_B, s + 1, k)] + latency - 1e-9
            if action.kind in (Kind.B, Kind.I):
                assert start >= end_of[(Kind.F, s, k)] - 1e-9
            if action.kind is Kind.F and s > 0:
                assert start >= end_of[(Kind.F, s - 1, k)] - 1e-9
    assert timeline.makespan >= max(timeline.busy(r) for r in range(schedule.num_ranks)) - 1e-9
