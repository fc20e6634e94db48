"""`pipetrain calibrate` and its measuring code: fits, the costs they give the simulator, and a real
measurement on two pinned workers that writes a file the simulator reads (figures plausible, speeds
not asserted: the machine may be loaded)."""

from __future__ import annotations

import json
import math

import pytest

from pipetrain.cli import main
from pipetrain.errors import PipetrainError
from pipetrain.runtime.calibrate import Fit, TransportFigures, fit_line
from pipetrain.schedule import build, load_costs, simulate


def test_fit_line_is_exact_on_a_line_and_weighs_small_sizes_as_much_as_large_ones():
    fit = fit_line([(1024, 1e-4 + 1024e-9), (65536, 1e-4 + 65536e-9), (1 << 20, 1e-4 + (1 << 20) * 1e-9)])
    assert fit.intercept == pytest.approx(1e-4) and fit.slope == pytest.approx(1e-9)
    # a 10 % error at the largest size barely moves the small-message intercept
    noisy = fit_line([(1024, 1e-4), (16384, 1e-4), (4 << 20, 2e-3)])
    assert noisy.intercept == pytest.approx(1e-4, rel=0.05)


def test_fit_line_never_gives_a_negative_time():
    falling = fit_line([(1024, 3e-4), (1 << 20, 1e-4)])
    assert falling.slope == 0 and falling.intercept == pytest.approx(2e-4, rel=0.5)
    through_origin = fit_line([(1000, 1e-6), (2000, 3e-6)])  # the line would cross at -1e-6
    assert through_origin.intercept == 0 and through_origin.slope > 0
    assert fit_line([]) == Fit(0.0, 0.0)


def test_the_sender_and_the_receiver_are_taken_out_of_the_one_way_time():
    figures = TransportFigures("gloo", one_way=Fit(50e-6, 2e-9), sender=Fit(10e-6, 0.5e-9),
                               receiver=Fit(15e-6, 0.5e-9), all_reduce=Fit(80e-6, 3e-9), step=Fit(0.0, 1e-10))
    costs = figures.costs()
    assert costs["latency"] == pytest.approx(25e-6) and costs["bandwidth"] == pytest.approx(1e9)
    assert (costs["send"], costs["recv"], costs["sync"], costs["step_per_byte"]) == (10e-6, 15e-6, 80e-6, 1e-10)
    busier = TransportFigures("gloo", one_way=Fit(20e-6, 1e-9), sender=Fit(15e-6, 1e-9), receiver=Fit(15e-6, 0.0),
                              all_reduce=Fit(0.0, 0.0))
    assert busier.costs()["latency"] == 0 and math.isinf(busier.costs()["bandwidth"])  # clamped


def test_calibrate_writes_a_file_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    code = main(["calibrate", "--out", str(out), "--sizes", "1024,65536"])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "gloo between 2 workers" in text and f"wrote {out}" in text
    data = json.loads(out.read_text())
    for name in ("send", "recv", "overhead", "sync", "step_per_byte"):
        assert 0 < data[name] < 1, (name, data[name])  # seconds, or seconds per byte
    assert data["latency"] >= 0 and data.get("bandwidth", math.inf) > 0
    assert data["measured_on"]["transport"] == "gloo" and data["measured_on"]["device"] == "cpu"
    costs = load_costs(str(out))  # measured here: no warning (pytest's settings make one an error)
    assert costs.overhead == data["overhead"] and costs.measured_on["transport"] == "gloo"
    costs.bytes = 16384
    charged = simulate(build("1f1b", 2, 4), costs).makespan
    assert charged > simulate(build("1f1b", 2, 4)).makespan  # F=1, B=2 plus the measured communication
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                 "--costs-file", str(out)]) == 0


def test_one_rank_writes_compute_only_costs_and_says_so(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert main(["calibrate", "--ranks", "1", "--out", str(out)]) == 0
    text = capsys.readouterr()[0]
    assert "one rank (--ranks 1): no transport to measure" in text
    data = json.loads(out.read_text())
    assert data["overhead"] > 0 and data["step_per_byte"] > 0
    assert not {"send", "recv", "latency", "bandwidth", "sync"} & set(data)
    assert data["measured_on"]["transport"] == "none" and "compute-only" in data["measured_on"]["note"]
    assert load_costs(str(out)).latency == 0


def test_calibrate_refuses_bad_options(capsys):
    assert main(["calibrate", "--sizes", "1024"]) == 2
    assert "--sizes needs two or more sizes" in capsys.readouterr()[1]
    assert main(["calibrate", "--optimizer", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr()[1]


def test_train_calibrates_first_when_asked_and_reports_against_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "report.json"
    small = ["train", "--model", "mlp:depth=2,width=8", "--data", "synthetic:features=6,classes=2,samples=64",
             "--batch-size", "8", "--microbatches", "2", "--stages", "2", "--steps", "6", "--quiet", "--no-progress"]
    # the costs file is the calibration's output: a directory that does not exist yet is made
    assert main([*small, "--calibrate", "--costs-file", "out/costs.json", "--report-json", str(report)]) == 0
    data = json.loads((tmp_path / "out" / "costs.json").read_text())
    assert data["overhead"] > 0 and data["measured_on"]["transport"] == "gloo"
    written = json.loads(report.read_text())
    assert written["calibrated"] is True and written["calibration"]["file"] == "out/costs.json"
    # a costs file that is no JSON output is refused before measuring
    assert main([*small, "--calibrate", "--costs-file", "costs.txt"]) == 2
    assert "--costs-file 'costs.txt'" in capsys.readouterr()[1] and not (tmp_path / "costs.txt").exists()


def test_a_torchrun_worker_reads_the_calibration_its_launcher_wrote(tmp_path, monkeypatch):
    from pipetrain.training.config import TrainConfig
    from pipetrain.training.train import _calibrated

    monkeypatch.chdir(tmp_path)
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                            LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    config = TrainConfig(calibrate=True, costs_file="mine.json")
    with pytest.raises(PipetrainError, match="pipetrain calibrate --out mine.json"):
        _calibrated(config)
    (tmp_path / "mine.json").write_text(json.dumps({"overhead": 1e-5}))
    assert _calibrated(config).costs_file == "mine.json"


def test_profile_calibrates_for_plan(tmp_path, capsys):
    profile, calibration = tmp_path / "p.json", tmp_path / "c.json"
    assert main(["profile", "--model", "mlp", "--data", "digits", "--out", str(profile), "--calibrate",
                 str(calibration), "--no-progress", "--iterations", "2", "--warmup", "1"]) == 0
    assert f"wrote calibration to {calibration}" in capsys.readouterr()[0]
    assert main(["plan", str(profile), "--workers", "2", "--costs-file", str(calibration), "--schedule", "auto",
                 "--no-baselines", "--json"]) == 0
    assert json.loads(capsys.readouterr()[0])["calibration"]["file"] == str(calibration)
