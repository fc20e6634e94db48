"""The planner and ``schedule="auto"`` over the newer schedules: zb-h2, the looped (interleaved, bfs,
interleaved-zb) and the V schedules (zb-v, v-half, v-min, dualpipev); their memory models against the
generated orders; a chunked plan trained by ``train --plan`` and ``Pipeline(plan=...)``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from pipetrain.cli import main
from pipetrain.errors import ConfigError
from pipetrain.plan.choose import CANDIDATES, choose_schedule, parse_auto
from pipetrain.plan.stage_memory import CHUNKED, in_flight, order_memory
from pipetrain.plan.planner import make_plan
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.profile_files import save_profile
from pipetrain.plan.search import search
from pipetrain.plan.topology import Topology
from pipetrain.schedule import build, memory_by_rank


def uniform(layers: int, activation: float = 1000.0, parameters: float = 100.0) -> Profile:
    return Profile([LayerProfile(f"l{i}", forward_s=1.0, backward_s=2.0, parameter_bytes=parameters,
                                 activation_bytes=activation) for i in range(layers)])


# -- memory models ------------------------------------------------------------------------------

@pytest.mark.parametrize("stages,m", [(2, 4), (3, 3), (4, 8), (4, 5), (5, 12)])
def test_zb_h2_holds_min_2d_minus_1_m_as_its_order_does(stages, m):
    depth = np.arange(stages, 0, -1)  # workers from each stage to the end
    order = memory_by_rank(build("zb-h2", stages, m))
    assert [r.peak_activations[s] for s, r in enumerate(order)] == list(in_flight("zb-h2", depth, 1, m))


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_v_schedules_hold_what_their_docstring_says(ranks):
    m = 2 * ranks
    peaks = {name: [r[3] for r in order_memory(name, ranks, m)] for name in ("zb-v", "v-half", "v-min", "dualpipev")}
    one = [r.rank_peak_activations for r in memory_by_rank(build("1f1b", ranks, m))]
    # in chunk-microbatches (a chunk is half a 1f1b stage): zb-v holds 1f1b's first rank's everywhere
    assert peaks["zb-v"] == [2 * one[0]] * ranks
    assert max(peaks["v-half"]) <= -(-2 * ranks // 2) + 1
    assert max(peaks["v-min"]) <= -(-2 * ranks // 3) + 1
    assert peaks["dualpipev"] == [p + 1 for p in peaks["zb-v"]]
    assert [r[3] for r in order_memory("bfs", ranks, m)] == [2 * m] * ranks  # every microbatch of both chunks


@pytest.mark.parametrize("name", CHUNKED)
def test_a_chunked_plans_memory_is_its_workers_from_the_order(name):
    plan = make_plan(uniform(16), Topology.flat(4, float("inf")), schedule=name, microbatches=8)
    assert plan.chunks == 2 and len(plan.stages) == 8 and plan.workers_used == 4
    for stages, held, versions, rank_held in order_memory(name, 4, 8):
        assert versions == (1, 1)
        # two layers a stage: 200 parameter bytes, 2000 activation bytes, 250 a microbatch
        expected = 2 * 200 + min(sum(held), rank_held) * 250
        assert all(plan.stages[s].memory_bytes == expected for s in stages)
        direct = memory_by_rank(build(name, 4, 8, chunks=2 if name in ("interleaved", "bfs", "interleaved-zb")
                                      else 1))
        assert held == tuple(direct[plan.extra["stages_of_worker"].index(list(stages))].peak_activations[s]
                             for s in stages)


# -- plan --schedule auto ----------------------------------------------------------------------

def test_auto_considers_every_schedule_and_a_v_wins_where_it_removes_the_bubble():
    plan = search(uniform(16), Topology.flat(4, float("inf")), microbatches=[8], memory_limit=2500)
    tried = {c["schedule"] for c in plan.extra["schedule_candidates"]}
    assert tried >= set(CHUNKED) | {"zb-h2", "zb-h1", "1f1b"}
    # F = I = W: zb-v has no bubble at 1f1b's memory; zb-h2 and 2bw need more than 2500 bytes
    assert (plan.schedule, plan.chunks, len(plan.stages)) == ("zb-v", 2, 8)
    times = {c["schedule"]: c.get("simulated_time_per_minibatch") for c in plan.extra["schedule_candidates"]}
    assert plan.extra["simulated_time_per_minibatch"] == pytest.approx(12.0)
    assert times["1f1b"] == pytest.approx(16.5) and times["zb-h1"] == pytest.approx(13.5)


def test_memory_forbids_zb_v_then_a_v_of_less_memory_wins():
    plan = search(uniform(16), Topology.flat(4, float("inf")), microbatches=[8], memory_limit=2000)
    assert plan.schedule == "v-half" and max(s.memory_bytes for s in plan.stages) == 1650
    fits = {c["schedule"]: c.get("fits") for c in plan.extra["schedule_candidates"]}
    assert fits["zb-v"] is False
    plan = search(uniform(16), Topology.flat(4, float("inf")), microbatches=[8], memory_limit=1500)
    assert plan.schedule == "v-min"


def test_a_v_that_cannot_fill_is_a_refused_candidate_not_a_failure():
    plan = search(uniform(16), Topology.flat(4, float("inf")), microbatches=[4])
    errors = {c["schedule"]: c["error"] for c in plan.extra["schedule_candidates"] if "error" in c}
    assert "zb-v" in errors and "at least 7 microbatches" in errors["zb-v"]
    assert plan.chunks == 1 or plan.schedule not in ("zb-v", "v-half", "v-min", "dualpipev")


# -- schedule auto for a run ---------------------------------------------------------------------

def test_choose_is_deterministic_and_follows_balance_and_memory():
    uniform_costs = [1.0] * 8
    first = choose_schedule(uniform_costs, 4, 8)
    assert first.schedule == "zb-v" and first.chunks == 2  # ties interleaved-zb: fewer messages first
    assert choose_schedule(uniform_costs, 4, 8).as_dict() == first.as_dict()
    assert [c["schedule"] for c in first.candidates] == list(CANDIDATES)
    # one heavy unit: two chunks per rank cannot balance it, one stage per rank can
    assert choose_schedule([1.0, 1.0, 1.0, 5.0], 2, 4).schedule == "zb-h1"
    assert choose_schedule(uniform_costs, 4, 8, memory=0.6).schedule == "v-min"
    with pytest.raises(ConfigError, match="auto:memory"):
        choose_schedule(uniform_costs, 4, 8, memory=0.1)
    assert parse_auto("auto:memory=2") == 2.0
    with pytest.raises(ConfigError, match="auto:memory=X"):
        parse_auto("auto:fast")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator),
                                          torch.randint(0, 3, (64,), generator=generator))


def test_pipeline_auto_trains_bitwise_as_the_schedule_it_chose(capsys):
    from pipetrain import Pipeline

    options = dict(stages=2, microbatches=4, executor="emulate", optimizer="sgd:lr=0.1", threads_per_worker=1)
    auto = Pipeline(_model(), schedule="auto", **options)
    chosen = auto.last_schedule if auto.last_schedule else None
    result = auto.fit(_data(), batch_size=8, steps=3)
    heading = capsys.readouterr().out
    choice = result.extra["schedule_choice"]
    assert f"schedule auto chose {choice['schedule']}" in heading and chosen is None
    assert result.schedule == choice["schedule"] == auto.schedule_name
    named = Pipeline(_model(), schedule=choice["schedule"], chunks=choice["chunks"]
                     if choice["schedule"] in ("interleaved", "bfs", "interleaved-zb") else 1, **options)
    again = named.fit(_data(), batch_size=8, steps=3)
    assert len(named.stages) == len(auto.stages)
    assert list(again.losses) == list(result.losses)
    for key, value in auto.state_dict().items():
        assert torch.equal(value, named.state_dict()[key]), key
    with pytest.raises(ConfigError, match="give microbatches"):
        Pipeline(_model(), schedule="auto", stages=2, executor="emulate")
    with pytest.raises(ConfigError, match="drop balance"):
        Pipeline(_model(), schedule="auto", balance=[3, 4], microbatches=4, executor="emulate")


SMALL = ["--data", "synthetic:features=8,classes=3,samples=64", "--batch-size", "8", "--no-progress",
         "--executor", "emulate", "--steps", "2"]


def test_train_schedule_auto_says_what_it_chose(capsys, tmp_path):
    report = tmp_path / "r.json"
    code = main(["train", "--model", "mlp:depth=7,width=16", *SMALL, "--schedule", "auto", "--stages", "2",
                 "--microbatches", "4", "--report-json", str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["schedule"] == data["schedule_choice"]["schedule"] in CANDIDATES
    assert f"schedule auto chose {data['schedule']}" in out and "priced by" in out
    code = main(["train", "--model", "mlp:depth=7,width=16", *SMALL, "--schedule", "auto", "--balance", "4,4"])
    assert code == 2 and "drop --balance" in capsys.readouterr().err


# -- a chunked plan, trained ----------------------------------------------------------------------

def _profile(path) -> None:
    """A profile of mlp:depth=7 (eight top-level modules) with equal layers."""
    layers = [LayerProfile("input", forward_s=0.0, backward_s=0.0, activation_bytes=256, input=True)] + [
        LayerProfile(str(i), forward_s=1e-3, backward_s=2e-3, parameter_bytes=1000, optimizer_bytes=1000,
                     activation_bytes=4000) for i in range(8)]
    save_profile(Profile(layers), path)


def test_plan_auto_chooses_zb_v_and_train_and_pipeline_take_the_plan(capsys, tmp_path):
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    _profile(profile)
    assert main(["plan", str(profile), "--workers", "2", "--schedule", "auto", "--microbatches", "8",
                 "--memory", "13000", "--bandwidth", "1e12", "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert (data["schedule"], data["chunks"], data["balance"], data["workers_used"]) == ("zb-v", 2, [2, 2, 2, 2], 2)
    capsys.readouterr()
    report = tmp_path / "r.json"
    code = main(["train", "--model", "mlp:depth=7,width=16", *SMALL, "--plan", str(plan), "--report-json",
                 str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "zb-v: 4 stages on 2 emulated ranks" in out and "(8 microbatches each)" in out
    assert json.loads(report.read_text())["workers"] == 2

    from pipetrain import Pipeline

    pipe = Pipeline(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), plan=str(plan), executor="emulate")
    assert pipe.schedule_name == "zb-v" and len(pipe.stages) == 4
    assert pipe.fit(_data(), batch_size=8, steps=1).workers == 2


def test_an_interleaved_plan_carries_its_chunks_to_train(capsys, tmp_path):
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    _profile(profile)
    assert main(["plan", str(profile), "--workers", "2", "--schedule", "interleaved", "--microbatches", "4",
                 "--out", str(plan)]) == 0
    assert "2 stages per worker" in capsys.readouterr().out
    report = tmp_path / "r.json"
    code = main(["train", "--model", "mlp:depth=7,width=16", *SMALL, "--plan", str(plan), "--report-json",
                 str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "interleaved: 4 stages on 2 emulated ranks" in out


def test_a_calibration_charges_the_plans_actions_and_messages_and_can_change_the_choice():
    """With an overhead per action (``pipetrain calibrate``'s), each plan's simulation costs more, by
    more for more microbatches (more actions); a large one turns auto away from many microbatches."""
    from pipetrain.plan.search import simulate_plan
    from pipetrain.schedule import Costs

    topology = Topology.flat(2, 1e9)
    plain = search(uniform(8), topology, schedules=["1f1b"], microbatches=[1, 2, 4, 8, 16, 32])
    assert plain.microbatches == 32
    slow = Costs(overhead=0.5, send=0.1, recv=0.1)
    charged = search(uniform(8), topology, schedules=["1f1b"], microbatches=[1, 2, 4, 8, 16, 32], calibration=slow)
    assert charged.microbatches < plain.microbatches
    for m in (2, 8):
        plan = make_plan(uniform(8), topology, schedule="1f1b", microbatches=m)
        alone = simulate_plan(plan, uniform(8), topology).time_per_minibatch
        assert simulate_plan(plan, uniform(8), topology, Costs(overhead=1e-3)).time_per_minibatch > alone
        step = Costs(step_per_byte=1.0)  # the step costs its stage's parameter bytes, in seconds
        assert simulate_plan(plan, uniform(8), topology, step).time_per_minibatch == pytest.approx(alone + 400)


def test_plan_reads_a_costs_file(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    save_profile(uniform(8), str(profile))
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"overhead": 0.5, "send": 0.1, "recv": 0.1}))
    out = tmp_path / "plan.json"
    assert main(["plan", str(profile), "--workers", "2", "--schedule", "auto", "--costs-file", str(calibration),
                 "--out", str(out), "--no-baselines"]) == 0
    data = json.loads(out.read_text())
    assert data["calibration"]["file"] == str(calibration) and data["microbatches"] < 32


def test_auto_with_a_calibration_charges_actions_and_turns_from_the_schedules_with_more_of_them():
    from pipetrain.schedule import Costs

    assert choose_schedule([1.0] * 8, 2, 8).schedule == "zb-v"  # the V removes the bubble when actions are free
    costly = choose_schedule([1.0] * 8, 2, 8, calibration=Costs(overhead=0.2, send=0.1, recv=0.1))
    assert costly.schedule in ("1f1b", "zb-h1")  # one stage per rank: half the messages of a V
    seconds = {c["schedule"]: c["seconds"] for c in costly.candidates if "seconds" in c}
    free = {c["schedule"]: c["seconds"] for c in choose_schedule([1.0] * 8, 2, 8).candidates if "seconds" in c}
    assert all(seconds[name] > free[name] for name in free)
