"""Tests of pipetrain.pb.study, pipetrain.pb.report and `pipetrain pb`: a CI-sized study."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pipetrain.cli import main
from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.pb.methods import parse_methods
from pipetrain.pb.report import markdown_tables, summarize, write_outputs
from pipetrain.pb.study import StudyConfig, is_diverged, plan_runs, run_study
from pipetrain.schedule import pb_delays

SMALL = "resmlp:depth=2,width=16,groups=4"


def _config(**overrides) -> StudyConfig:
    options = dict(
        model=SMALL, data="synthetic:features=8,classes=3,samples=200,seed=1", stages=(4,),
        methods=tuple(parse_methods("sgd-batch,sgd,pb,pb+sc,pb+lwp,pb+sc0.5+lwp0.5")), seeds=(0,),
        epochs=2.0, reference_batch=8, lr=0.2, momentum=0.9, lr_scales=(1.0,),
    )
    options.update(overrides)
    return StudyConfig(**options)


@pytest.fixture(scope="module")
def small_study():
    return run_study(_config())


def test_ci_sized_study_trains_every_method(small_study):
    result = small_study
    assert result.train_samples == 200 and result.test_samples == 200
    names = [r.method for r in result.runs]
    assert names == ["sgd-batch", "sgd", "pb", "pb+sc", "pb+lwp", "pb+sc0.5+lwp0.5"]
    for run in result.runs:
        assert run.engine == "batched"
        assert run.samples == 400
        assert not run.diverged
        assert len(run.curve) == 40
        # the loop trains: the online loss falls and the final model beats chance clearly
        assert run.curve[-1] < run.curve[0]
        assert run.test_accuracy > 0.6
    sgd, batch = result.runs[1], result.runs[0]
    assert batch.batch_size == 8 and sgd.batch_size == 1
    assert sgd.momentum == pytest.approx(0.9 ** (1 / 8))
    assert sgd.lr == pytest.approx(0.2 * (1 - 0.9 ** (1 / 8)) / (8 * 0.1))
    assert result.hyperparameters["translated"]["lr"] == pytest.approx(sgd.lr)
    # PB with and without compensation differ (delays and compensation are at work)
    losses = {r.method: r.final_train_loss for r in result.runs}
    assert len(set(losses.values())) == len(losses)


def test_compensation_settings_per_stage():
    from pipetrain.pb.study import _Trainer

    config = _config()
    trainer = _Trainer(config, None)
    spec = [s for s in plan_runs(config) if s.method.name == "pb+sc0.5+lwp0.5"][0]
    _, stages, optimizers = trainer._build(spec)
    assert len(stages) == 4
    assert [o.sc_delay for o in optimizers] == [0.5 * d for d in pb_delays(4)]
    assert [o.lwp_horizon for o in optimizers] == [0.5 * d for d in pb_delays(4)]
    swept = _config(delay_scales=(2.0,))
    spec = [s for s in plan_runs(swept) if s.method.name == "pb+sc"][0]
    _, _, optimizers = _Trainer(swept, None)._build(spec)
    assert [o.sc_delay for o in optimizers] == [2.0 * d for d in pb_delays(4)]
    assert optimizers[0].lr_schedule.total == 400
    # DLR: the rate per stage from its delay (D* = 2: delays 6, 4, 2, 0), not swept by --delay-scale
    swept = _config(methods=tuple(parse_methods("pb+sc0.5+lwp+dlr2")), delay_scales=(2.0,))
    spec = plan_runs(swept)[0]
    _, _, optimizers = _Trainer(swept, None)._build(spec)
    lr = trainer.settings(spec)[1]
    assert [o.lr for o in optimizers] == [lr * (2 / 6) ** 2, lr * (2 / 4) ** 2, lr, lr]
    assert [o.sc_delay for o in optimizers] == [d for d in pb_delays(4)]
    assert [o.lwp_horizon for o in optimizers] == [2.0 * d for d in pb_delays(4)]


def test_a_runs_result_does_not_depend_on_its_engine_mates():
    # runs train many to an engine; a run's bits must not depend on which others share it (a
    # resumed study, or a study of other methods, groups them differently). DTS gives its deep
    # stages another momentum, the case that once changed a run's float32 arithmetic.
    from pipetrain.pb.study import _Trainer

    config = _config(model="resmlp:depth=6,width=16,groups=4", stages=(8,), epochs=0.5,
                     methods=tuple(parse_methods("pb+sc+lwp,pb+sc+lwp+dts2")))
    trainer = _Trainer(config, None)
    plain, scaled = plan_runs(config)

    def row(result):
        return {**result.row(curve=True), "seconds": 0.0}

    alone = [row(trainer.train([spec])[0]) for spec in (plain, scaled)]
    together = [row(r) for r in trainer.train([plain, scaled])]  # one engine for both
    assert together[1] == alone[1]  # the DTS run: its engine multiplies by a column either way
    # the study keeps runs of one momentum apart from runs of several, whose engine must use columns
    assert trainer.engine_key(plain) != trainer.engine_key(scaled)
    result = run_study(config)
    assert [{**r.row(curve=True), "seconds": 0.0} for r in result.runs] == alone


def test_plan_runs_counts():
    config = _config(stages=(2, 4), seeds=(0, 1), lr_scales=(0.5, 1.0), delay_scales=(0.5, 1.0))
    runs = plan_runs(config)
    per_method = {}
    for run in runs:
        per_method[run.method.name] = per_method.get(run.method.name, 0) + 1
    assert per_method["sgd"] == per_method["sgd-batch"] == 4  # lr scales x seeds
    assert per_method["pb"] == 8  # x stages
    assert per_method["pb+sc"] == 16  # x delay scales


def test_report_tables_and_files(small_study, tmp_path):
    rows = summarize(small_study.runs)
    sgd = [r for r in rows if r["method"] == "sgd"][0]
    assert sgd["accuracy_gap_vs_sgd"] == 0.0 and sgd["loss_ratio_vs_sgd"] == 1.0
    text = markdown_tables(small_study, rows)
    assert "| method | no pipeline | S=4 |" in text
    assert "| pb+sc |" in text
    written = write_outputs(small_study, tmp_path / "out", command="pipetrain pb ...")
    names = sorted(p.name for p in written)
    assert names == ["accuracy_vs_stages.png", "loss_curves.png", "results.json", "results.md", "runs.csv", "summary.csv"]
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(payload["results"]) == 6 and len(payload["curves"]) == 6


def test_divergence_rule():
    assert is_diverged(float("nan"), True, 10)
    assert is_diverged(0.1, False, 10)
    assert is_diverged(0.5 * math.log(10) + 0.01, True, 10)
    assert not is_diverged(0.5 * math.log(10) - 0.01, True, 10)
    # when batch-1 SGD with the same seed and lr did not get far either, that is no divergence
    assert not is_diverged(1.5, True, 10, reference_loss=0.5)
    assert is_diverged(1.5, True, 10, reference_loss=0.01)
    assert is_diverged(float("inf"), True, 10, reference_loss=0.5)


def test_command_json(capsys):
    code = main([
        "pb", "--model", SMALL, "--data", "synthetic:features=8,classes=3,samples=120,seed=1", "--stages", "4",
        "--methods", "sgd,pb+sc", "--seeds", "1", "--epochs", "1", "--reference-batch", "8", "--lr", "0.2",
        "--lr-scale", "0.5,1", "--json", "--no-progress",
    ])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    rows = payload["results"]
    assert len(rows) == 4
    for row in rows:
        for key in ("method", "stages", "lr_scale", "seed", "test_accuracy", "final_train_loss", "diverged"):
            assert key in row
    assert {(r["method"], r["stages"], r["lr_scale"]) for r in rows} == {
        ("sgd", None, 0.5), ("sgd", None, 1.0), ("pb+sc", 4, 0.5), ("pb+sc", 4, 1.0)}


def test_command_table_with_test_data(capsys):
    code = main([
        "pb", "--model", SMALL, "--data", "synthetic:features=8,classes=3,samples=60,seed=1",
        "--test-data", "synthetic:features=8,classes=3,samples=30,seed=1,split=test", "--stages", "3",
        "--methods", "pb", "--seeds", "1", "--epochs", "1", "--no-progress",
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "60 train / 30 test samples" in out
    assert "| pb |" in out


def _bn_module(tmp_path, monkeypatch):
    (tmp_path / "pb_bn_nets.py").write_text(
        "from torch import nn\n"
        "def bn(in_features, num_classes):\n"
        "    return [nn.Linear(in_features, 8), nn.Sequential(nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, num_classes)]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return "pb_bn_nets:bn"


def test_bad_input_clear_messages(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"^stages=\[5\]: model .* has only 4 top-level units .*keep stages at 4 or fewer") as info:
        run_study(_config(stages=(4, 5)))
    assert info.value.options == ("stages", "stages")
    spec = _bn_module(tmp_path, monkeypatch)
    with pytest.raises(PipetrainError, match="BatchNorm"):
        run_study(_config(model=spec, stages=(3,)))
    base = ["pb", "--data", "synthetic:features=8,classes=3,samples=40", "--no-progress", "--epochs", "1"]
    assert main(base + ["--model", spec, "--stages", "3"]) == 2
    assert "BatchNorm" in capsys.readouterr().err
    assert main(base + ["--model", SMALL, "--stages", "9"]) == 2
    err = capsys.readouterr().err
    assert "--stages 9" in err and "only 4 top-level units" in err
    assert main(base + ["--model", SMALL, "--methods", "pb+xyz"]) == 2
    assert "pb+xyz" in capsys.readouterr().err


def test_parallel_workers_give_the_same_results():
    config = _config(methods=tuple(parse_methods("sgd,pb+lwp")), stages=(2, 4), epochs=0.5)
    serial = run_study(config)
    parallel = run_study(_config(methods=config.methods, stages=(2, 4), epochs=0.5, workers=2))
    assert [r.row() for r in parallel.runs] == [
        {**r.row(), "seconds": p.seconds} for r, p in zip(serial.runs, parallel.runs)
    ]


def test_results_json_round_trip(small_study, tmp_path):
    from pipetrain.pb.report import load_results, study_command

    write_outputs(small_study, tmp_path)
    loaded = load_results(tmp_path / "results.json")
    assert loaded.config == small_study.config
    assert [r.row(curve=True) for r in loaded.runs] == [r.row(curve=True) for r in small_study.runs]
    command = study_command(small_study.config)
    assert command.startswith("pipetrain pb --model resmlp:depth=2,width=16,groups=4 --data")
    assert "--methods sgd-batch,sgd,pb,pb+sc,pb+lwp,pb+sc0.5+lwp0.5" in command
