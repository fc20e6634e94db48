"""Tests of balancing stages by measured time, and of the record of the chosen stages.

The model that tells time from parameters apart has a first unit that does nearly all the work and
holds no parameters, followed by light units that hold them all: balancing parameters cuts after
the second unit, balancing time right after the first. The gap is tens of times, so the choice
does not depend on the machine's speed (the test asserts the choice, never a time).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models import cross_entropy
from pipetrain.execution.unit_timing import measure_unit_costs, split_by_time
from pipetrain.stages import StageChoice, split_model, unit_names
from pipetrain.training import TrainConfig
from pipetrain.training.setup import prepare
from pipetrain.training.files import write_outputs

WIDTH = 128


class Heavy(nn.Module):
    """Forty products with a fixed matrix: much work, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        for _ in range(40):
            x = torch.tanh(x @ self.mix)
        return x


def heavy_first(num_classes: int = 3) -> nn.Sequential:
    light = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)]
    return nn.Sequential(nn.Linear(8, WIDTH), Heavy(), *light, nn.Linear(WIDTH, num_classes))


class Wrapped(nn.Module):
    """The same units inside an ordinary module (cut by tracing)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = heavy_first()

    def forward(self, x):
        return self.body(x) * 1.0


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_measured_time_cuts_after_the_heavy_unit_where_parameters_do_not():
    torch.manual_seed(0)
    model = heavy_first()
    assert split_model(model, stages=2).balance == [3, 3]  # parameters: the light units split evenly
    x, y = batch()
    staged, choice = split_by_time(model, 2, x, y, cross_entropy)
    assert staged.balance == [2, 4]
    assert choice.how == "measured time" and choice.starts == [None, "2"] and choice.split_at == ["2"]
    assert choice.time_shares[0] > 0.6 and choice.parameters == staged.parameter_counts()
    assert set(choice.unit_seconds) == {str(i) for i in range(6)}


def test_traced_models_are_timed_by_unit_too():
    torch.manual_seed(0)
    model = Wrapped()
    light = [f"body.{i}.{j}" for i in (2, 3, 4) for j in (0, 1)]
    assert unit_names(model, 2) == ["body.0", "body.1", *light, "body.5"]  # containers open into their layers
    x, y = batch()
    staged, choice = split_by_time(model, 2, x, y, cross_entropy)
    assert staged.split_at == ["body.2.0"] and choice.split_at == ["body.2.0"]
    lines = choice.lines()
    assert lines[0] == "stages balanced by measured time:" and "from body.2.0" in lines[2]
    assert "% of the measured time" in lines[1]


def test_measuring_leaves_the_model_and_the_random_state_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.5), nn.Linear(WIDTH, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    costs = measure_unit_costs(model, x, y, cross_entropy, stages=2, repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert set(costs) == {"0", "1", "2", "3"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_given_costs_reproduce_a_cut_and_must_fit_the_model():
    model = heavy_first()
    costs = {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0, "4": 5.0, "5": 1.0}
    staged, choice = split_by_time(model, 2, None, None, None, costs=costs)
    assert staged.balance == [4, 2] and choice.seconds == [4.0, 6.0]
    with pytest.raises(ConfigError, match="lack"):
        split_by_time(model, 2, None, None, None, costs={"0": 1.0})


FACTORY = '''
import torch
from torch import nn
import test_stages_balance as t


def heavy_first(num_classes):
    return t.heavy_first(num_classes)


def tied_inside(num_classes):
    """Units 1 and 3 share a weight: some cuts put them in one stage, others not."""
    first, second = nn.Linear(t.WIDTH, t.WIDTH), nn.Linear(t.WIDTH, t.WIDTH)
    second.weight = first.weight
    return [nn.Linear(8, t.WIDTH), first, nn.Tanh(), second, nn.Linear(t.WIDTH, num_classes)]
'''


@pytest.fixture
def factory(tmp_path, monkeypatch):
    import os
    import sys

    (tmp_path / "heavynets.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    yield "heavynets:heavy_first"
    sys.modules.pop("heavynets", None)


def config(model: str, **options) -> TrainConfig:
    base = dict(data="synthetic:features=8,classes=3,samples=64", batch_size=8, steps=2, stages=2, executor="emulate",
                progress=False, optimizer="sgd:lr=0.05")
    return TrainConfig(model=model, **{**base, **options})


def test_auto_times_synchronous_schedules_and_counts_parameters_on_asynchronous_ones(factory):
    run = prepare(config(factory, schedule="1f1b"))
    assert run.stage_choice.how == "measured time" and run.staged.balance == [2, 4]
    assert run.stage_costs == run.stage_choice.unit_seconds
    run = prepare(config(factory, schedule="pipedream"))
    assert run.stage_choice.how == "parameter count" and run.staged.balance == [3, 3]
    assert "pipedream" in run.stage_choice.note and run.stage_costs is None
    run = prepare(config(factory, schedule="pipedream", balance_by="time"))
    assert run.stage_choice.how == "measured time" and run.staged.balance == [2, 4]
    run = prepare(config(factory, schedule="1f1b", balance_by="params"))
    assert run.stage_choice.how == "parameter count" and run.staged.balance == [3, 3]
    run = prepare(config(factory, split_at=["4"]))
    assert run.stage_choice.how == "--split-at" and run.stage_choice.starts == [None, "4"]
    with pytest.raises(ConfigError, match="unknown balance_by 'speed'") as refused:
        prepare(config(factory, balance_by="speed"))
    assert refused.value.options == ("balance_by",)


def test_dropout_and_tied_weights_keep_the_parameter_count_under_auto(factory):
    run = prepare(config("gpt:n_layer=2,n_embd=16,n_head=2,dropout=0.1", data="text:block_size=8"))
    assert run.stage_choice.how == "parameter count" and "dropout" in run.stage_choice.note
    run = prepare(config(factory.replace("heavy_first", "tied_inside"), stages=3))
    assert run.stage_choice.how == "parameter count" and "tied" in run.stage_choice.note
    # an LM head tied to the input embedding: every cut gives it to the first and the last stage
    run = prepare(config("gpt:n_layer=2,n_embd=16,n_head=2,tie=true", data="text:block_size=8"))
    assert run.stage_choice.how == "measured time" and [t.stages for t in run.staged.tied] == [(0, 1)]


def test_given_stage_costs_cut_without_measuring_and_reach_the_report(factory, tmp_path, capsys, monkeypatch):
    """The unit times a launcher hands its workers (beside the configuration, not in it) cut alike."""
    from pipetrain.execution import unit_timing
    from pipetrain.training.emulated import train_emulated

    costs = {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0, "4": 5.0, "5": 1.0}
    report = tmp_path / "report.json"
    monkeypatch.setattr(unit_timing, "measure_unit_costs", lambda *a, **k: pytest.fail("timed although given the costs"))
    run = prepare(config(factory, report_json=str(report)), stage_costs=costs)
    assert run.stage_costs == costs and "stage_costs" not in vars(run.config)
    write_outputs(run.config, train_emulated(run), run)
    out = capsys.readouterr().out
    assert "; stages balanced by measured time\ndata: " in out and "\nstage 0: " in out  # heading, data, stages
    assert "from 4" in out and "60.0 % of the measured time" in out
    choice = json.loads(report.read_text())["stage_choice"]
    assert choice["how"] == "measured time" and choice["split_at"] == ["4"]
    assert [s["parameters"] for s in choice["stages"]] == [8 * WIDTH + WIDTH + 2 * (WIDTH * WIDTH + WIDTH),
                                                           WIDTH * WIDTH + WIDTH + WIDTH * 3 + 3]
    assert [round(s["time_share"], 3) for s in choice["stages"]] == [0.4, 0.6]
    assert choice["unit_seconds"] == costs


def test_stage_choice_of_an_unnamed_list():
    staged = split_model([nn.Linear(2, 2), nn.Linear(2, 2)])
    choice = StageChoice.of(staged, "stage modules")
    assert choice.starts == [None, None] and choice.split_at == []
    assert choice.lines()[0] == "stages given by stage modules:"


class Trunk(nn.Module):
    """Two heavy parts inside an ordinary module (not a container): one unit until timed."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Heavy(), Heavy()

    def forward(self, x):
        return self.second(self.first(x)) + x


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.trunk = Trunk()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(self.trunk(self.inp(x)))


def test_a_unit_holding_most_of_the_time_is_opened_and_timed_in_parts():
    torch.manual_seed(0)
    model = Deep()
    assert unit_names(model, 2) == ["inp", "trunk", "head"]
    assert split_model(model, stages=2).split_at == ["trunk"]  # by parameters: the trunk has none
    x, y = batch()
    staged, choice = split_by_time(model, 2, x, y, cross_entropy)
    assert staged.split_at == ["trunk.second"]
    assert set(choice.unit_seconds) == {"inp", "trunk.first", "trunk.second", "head"}
    again, _ = split_by_time(model, 2, None, None, None, costs=choice.unit_seconds)  # reproduced
    assert again.split_at == ["trunk.second"]


def test_parameter_balance_opens_a_unit_bigger_than_a_stage():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.cut_balance import vit

    model = vit((3 * 16 * 16,), 1000, layers=4, dim=32)  # the encoder holds most parameters: opened
    assert split_model(model, stages=2).split_at[0].startswith("encoder.layers.encoder_layer_")
