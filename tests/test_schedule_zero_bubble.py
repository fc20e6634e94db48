"""The zero-bubble frontier: zb-h2, the V schedules (zb-v, v-half, v-min) and zb-auto.

Pinned at F = I = W = 1 against the papers' closed forms (docs/design.md 3.1) and small orders
derived by hand; activations in microbatches of one stage of the unchunked model (a V chunk is
half a stage)."""

from __future__ import annotations

import json

import pytest

from pipetrain.cli import main
from pipetrain.errors import ConfigError, ScheduleError
from pipetrain.schedule import Costs, Kind, build, check, load, memory_by_rank, simulate, strip_communication
from pipetrain.schedule.auto import candidates, peak_activations
from pipetrain.schedule.greedy import greedy_order
from pipetrain.schedule.vshape import v_placement

UNIT = Costs(F=1, B=1, W=1)


def compute_order(schedule) -> list[str]:
    return [" ".join(str(a).split("@")[0] for a in p if a.kind is not Kind.STEP)
            for p in strip_communication(schedule).programs]


def held_until_w(schedule) -> int:
    """The most microbatches a rank holds from F to W (the papers' accounting of a split backward)."""
    best = 0
    for program in schedule.programs:
        held = 0
        for action in program:
            held += action.kind is Kind.F
            held -= action.kind is Kind.W
            best = max(best, held)
    return best


def bubble(schedule, costs=UNIT) -> float:
    timeline = simulate(schedule, costs)
    busy = sum(timeline.busy(r) for r in range(schedule.num_ranks))
    return 1 - busy / (timeline.makespan * schedule.num_ranks)


# -- zb-h2 -----------------------------------------------------------------------------------------


def test_zb_h2_order_by_hand():
    """S = 2, m = 3: stage 0 runs 2(S-1) = 2 warm-up forwards and W at once; stage 1 defers W by 2."""
    assert compute_order(build("zb-h2", 2, 3)) == [
        "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2",
    ]
    assert simulate(build("zb-h2", 2, 3), UNIT).makespan == 10


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("steps", [1, 3])
def test_zb_h2_has_no_idle_in_the_steady_state(stages, extra, steps):
    """m >= 2S-1 at F = I = W = 1: stage s works without a gap from s to its end (a parallelogram),
    so n steps take 3mn + S - 1, the idle only the first step's ramp and the last one's drain."""
    m = 2 * stages - 1 + extra
    schedule = build("zb-h2", stages, m, steps=steps)
    timeline = simulate(schedule, UNIT)
    assert timeline.makespan == 3 * m * steps + stages - 1
    for stage in range(stages):
        spans = [(start, end) for action, start, end in timeline.spans(stage) if action.kind in (Kind.F, Kind.I, Kind.W)]
        assert spans[0][0] == stage
        assert all(a_end == b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] == 3 * m * steps + stage


@pytest.mark.parametrize("stages", [1, 2, 4, 5])
def test_zb_h2_holds_twice_1f1b_activations(stages):
    """Peak 2(S-s)-1 on stage s: 2S-1 on stage 0, about twice 1f1b's S; counted until W, 2S-1 on every stage."""
    m = 3 * stages
    memory = memory_by_rank(build("zb-h2", stages, m))
    assert [memory[s].peak_activations[s] for s in range(stages)] == [2 * (stages - s) - 1 for s in range(stages)]
    assert held_until_w(build("zb-h2", stages, m)) == 2 * stages - 1
    assert peak_activations(build("1f1b", stages, m)) == stages


def test_zb_h2_beats_zb_h1_over_steps():
    """ZB-H1 pays its ramp every step, ZB-H2 once: (S-1)/(3mn+S-1) against n(S-1)/(n(3m+S-1))."""
    h1, h2 = (simulate(build(name, 4, 8, steps=3), UNIT).makespan for name in ("zb-h1", "zb-h2"))
    assert (h1, h2) == (3 * (24 + 3), 72 + 3)


# -- the V schedules ------------------------------------------------------------------------------


def test_v_placement_and_local_turn():
    """Rank r holds stages r and 2R-1-r; at the turn (rank R-1, stages R-1 and R) no message."""
    schedule = build("zb-v", 3, 5)
    assert schedule.stage_ranks == [[0], [1], [2], [2], [1], [0]]
    assert schedule.chunks == 2 and schedule.rank_stages() == [[0, 5], [1, 4], [2, 3]]
    messages = [a for p in schedule.programs for a in p if a.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)]
    assert not [a for a in messages if (a.kind in (Kind.SEND_F, Kind.RECV_B) and a.stage == 2)
                or (a.kind in (Kind.RECV_F, Kind.SEND_B) and a.stage == 3)]
    assert {a.stage for a in messages if a.kind is Kind.SEND_F} == {0, 1, 3, 4}
    check(schedule)


def test_zb_v_order_by_hand():
    """R = 2, m = 3 from the phase table of vshape.zb_v_order (rank 0: 3 warm-up forwards of chunk 0,
    then F I W of chunk 1 twice; rank 1: F0, then F1 F0, then F1 I1 W1, one steady round, cool-down)."""
    assert compute_order(build("zb-v", 2, 3)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ]
    assert simulate(build("zb-v", 2, 3), UNIT).makespan == 9.5


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 7])
@pytest.mark.parametrize("steps", [1, 2])
def test_zb_v_closed_form_and_1f1b_memory(ranks, extra, steps):
    """At F = I = W = 1 (a chunk's F, I, W 1/2 each) and m >= 2R-1 a step takes 3m + (R-1)/2: rank
    R-1 starts at (R-1)/2 and is never idle again, the least any order can do. Peak activations
    are 1f1b's, R, also held until W; over several steps the ramp is paid once."""
    m = 2 * ranks - 1 + extra
    schedule = build("zb-v", ranks, m, steps=steps)
    assert simulate(schedule, UNIT).makespan == 3 * m * steps + (ranks - 1) / 2
    assert peak_activations(schedule) == peak_activations(build("1f1b", ranks, m)) == ranks
    assert held_until_w(schedule) == 2 * ranks  # chunk units


@pytest.mark.parametrize("ranks", [4, 8, 12])
def test_v_half_and_v_min_memory_and_bubble(ranks):
    """v-half holds (R+1)/2 stage-microbatches, v-min (ceil(2R/3)+1)/2 (about 1/2 and 1/3 of 1f1b's
    R as R grows); at F = I = W with m = 4R v-half's bubble is below 1f1b's, v-min's near it."""
    m = 4 * ranks
    one_f_one_b = bubble(build("1f1b", ranks, m))
    half, least = build("v-half", ranks, m), build("v-min", ranks, m)
    assert peak_activations(half) == (ranks + 1) / 2
    assert peak_activations(least) == (-(-2 * ranks // 3) + 1) / 2
    assert bubble(half) < 0.65 * one_f_one_b
    assert bubble(least) < 1.4 * one_f_one_b
    assert bubble(build("zb-v", ranks, m)) < 0.25 * one_f_one_b


def test_v_schedules_on_unbalanced_ranks_read_costs_per_rank():
    """A cost list with one entry per rank gives both of a rank's chunks half of it (the V, not
    the interleaved placement)."""
    timeline = simulate(build("zb-v", 2, 3), Costs(F=[1, 3], B=[1, 3], W=[1, 3]))
    assert timeline.costs.forward == [0.5, 1.5, 1.5, 0.5]


def test_greedy_never_exceeds_its_limit_and_covers_every_action():
    placement = v_placement(3)
    for limit in (2, 3, 4, 6):
        for until_w in (True, False):
            programs = greedy_order(placement, 7, [1, 2, 1, 1, 2, 1], [2, 1, 1, 2, 1, 1], [1] * 6, [limit] * 3,
                                    until_w=until_w)
            for program in programs:
                held = 0
                for action in program:
                    held += action.kind is Kind.F
                    held -= action.kind is (Kind.W if until_w else Kind.I)
                    assert held <= limit
                assert len(program) == 3 * 7 * 2


# -- zb-auto --------------------------------------------------------------------------------------

UNBALANCED = Costs(F=[1, 2, 1], B=[2, 2, 1], W=[1, 1, 2])


def test_zb_auto_beats_zb_h1_and_zb_v_on_unbalanced_stages():
    """Its greedy search waits where the costs say: shorter than both fixed zero-bubble orders."""
    auto = build("zb-auto", 3, 12, costs=UNBALANCED)
    times = {name: simulate(build(name, 3, 12), UNBALANCED).makespan for name in ("zb-h1", "zb-v")}
    assert simulate(auto, UNBALANCED).makespan < min(times.values())
    assert auto.meta["chosen"].startswith("greedy")
    assert peak_activations(auto) <= 3
    check(auto)


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
@pytest.mark.parametrize("costs", [UNIT, UNBALANCED, Costs(F=[3, 1, 1], B=[3, 1, 2], W=[1, 1, 3])])
def test_zb_auto_respects_the_limit_and_is_never_worse_than_a_fixed_schedule(limit, costs):
    """Compared as it chooses, over two steps (what a run pays per step)."""
    m = 6
    auto = build("zb-auto", 3, m, steps=2, costs=costs, memory_limit=limit)
    assert peak_activations(auto) <= limit
    mine = simulate(auto, costs).makespan
    for name in ("1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"):
        fixed = build(name, 3, m, steps=2)
        if peak_activations(fixed) <= limit:
            assert mine <= simulate(fixed, costs).makespan, name
    assert set(candidates(3, m, costs, limit)) >= {"greedy", "greedy-v"}


def test_zb_auto_picks_zb_v_for_balanced_stages():
    assert build("zb-auto", 4, 8).meta["chosen"] == "zb-v"
    assert build("zb-auto", 4, 8).chunks == 2
    assert build("zb-auto", 4, 2).chunks == 1  # too few microbatches for a V


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-v", "v-half", "v-min"])
def test_v_schedules_refuse_too_few_microbatches_and_replicas(name):
    with pytest.raises(ScheduleError, match=r"at least 5 microbatches.*microbatches=5"):
        build(name, 3, 4)
    with pytest.raises(ScheduleError, match="replicated"):
        build(name, 2, 4, replicas=[2, 1])
    with pytest.raises(ScheduleError, match="chunks"):
        build(name, 2, 4, chunks=3)
    assert build(name, 2, 4, chunks=2).chunks == 2


def test_other_refusals():
    with pytest.raises(ScheduleError, match="replicated"):
        build("zb-h2", 2, 4, replicas=[2, 1])
    with pytest.raises(ScheduleError, match="memory_limit applies to zb-auto only"):
        build("zb-v", 2, 4, memory_limit=2)
    with pytest.raises(ScheduleError, match="memory_limit"):
        build("zb-auto", 2, 4, memory_limit=0)


def test_pipeline_refuses_zb_auto_without_microbatches():
    import torch.nn as nn

    from pipetrain import Pipeline

    with pytest.raises(ConfigError, match="microbatches"):
        Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), schedule="zb-auto", executor="emulate")


# -- the command ----------------------------------------------------------------------------------


def test_command_draws_traces_and_writes_a_v_schedule(tmp_path, capsys):
    csv, plot, trace = tmp_path / "v.csv", tmp_path / "v.png", tmp_path / "v.json"
    code = main(["schedule", "zb-v", "--stages", "3", "--microbatches", "5", "--costs", "F=1,B=1,W=1",
                 "--csv", str(csv), "--plot", str(plot), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert code == 0 and "2 chunks per rank" in out and "peak activations     3 microbatches" in out
    assert plot.stat().st_size > 0 and json.loads(trace.read_text())
    loaded = load(str(csv))
    assert loaded.stage_ranks == build("zb-v", 3, 5).stage_ranks and loaded.chunks == 2
    assert simulate(loaded, UNIT).makespan == 15 + 1


def test_command_zb_auto_uses_costs_and_memory_limit(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"F": [1, 2, 1], "B": [2, 2, 1], "W": [1, 1, 2]}))
    code = main(["schedule", "--compare", "zb-h1,zb-v,zb-auto", "--stages", "3", "--microbatches", "12",
                 "--costs-file", str(costs), "--json"])
    data = json.loads(capsys.readouterr().out)["schedules"]
    assert code == 0
    h1, v, auto = (s["makespan"] for s in data)
    assert auto < min(h1, v)
    code = main(["schedule", "zb-auto", "--stages", "3", "--microbatches", "12", "--costs-file", str(costs),
                 "--memory-limit", "2", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["peak_activation_memory"] <= 2
    assert main(["schedule", "zb-v", "--memory-limit", "2"]) == 2
    assert "--memory-limit applies to zb-auto only" in capsys.readouterr().err


def test_train_refuses_a_v_before_cutting(capsys):
    base = ["train", "--model", "mlp:depth=5,width=16", "--data", "synthetic:features=8,classes=3,samples=48",
            "--batch-size", "12", "--steps", "1", "--executor", "emulate", "--no-progress"]
    assert main([*base, "--schedule", "v-half", "--stages", "3", "--microbatches", "4"]) == 2
    assert "needs at least 5 microbatches per step (2R-1) to fill its V, got 4: use --microbatches 5" in \
        capsys.readouterr().err
    assert main([*base[:2], "mlp:depth=2,width=16", *base[3:], "--schedule", "zb-v", "--stages", "3",
                 "--microbatches", "5"]) == 2
    assert "cuts the model into 2 chunks per rank, 6 stages for 3 ranks, but it has 3 top-level modules: use " \
           "--stages 1 or fewer" in capsys.readouterr().err
