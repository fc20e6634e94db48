"""How well a run was predicted: the report's measured and simulated seconds per update, read alike
(the median gap between update ends after the first fifth), compute-only without a calibration and
with its communication and overhead with one; a malformed calibration is refused before the run."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest

from pipetrain.errors import ConfigError
from pipetrain.schedule import Costs, build, simulate
from pipetrain.training.config import TrainConfig
from pipetrain.training.prediction import calibrated_costs, prediction
from pipetrain.training.timelines import action_overhead, measured_costs, seconds_per_update, update_ends

SMALL = dict(schedule="pipedream", stages=2, model="mlp:depth=2,width=8", data="synthetic:features=6,classes=2,samples=64",
             batch_size=4, steps=30, progress=False, quiet=True)


def test_seconds_per_update_is_the_median_gap_after_the_first_fifth():
    ends = [0.0, 10.0, 11.0, 12.0, 14.0, 15.0, 16.0, 30.0, 31.0, 32.0]  # first fifth: 0 and 10 left out
    assert seconds_per_update(ends) == 1.0
    assert seconds_per_update([0.0, 5.0]) == 5.0 and seconds_per_update([1.0]) is None


def test_the_calibration_adds_communication_and_overhead_to_the_measured_compute():
    measured = simulate(build("1f1b", 2, 4, steps=6), Costs(F=1e-3, B=2e-3, step=1e-4))
    compute = measured_costs(measured)
    assert compute.F == [pytest.approx(1e-3)] * 2 and compute.step == [pytest.approx(1e-4)] * 2
    calibration = Costs(overhead=1e-5, send=2e-5, send_per_byte=1e-9, recv=3e-5, latency=5e-5, bandwidth=1e9,
                        sync=1e-4, sync_per_byte=1e-9)
    costs = calibrated_costs(compute, calibration, message_bytes=[4096, 4096], parameter_bytes=[1000, 2000])
    assert costs.bytes == [4096, 4096] and costs.sync == [pytest.approx(1.01e-4), pytest.approx(1.02e-4)]
    assert (costs.overhead, costs.send, costs.recv, costs.latency) == (1e-5, 2e-5, 3e-5, 5e-5)
    alone = seconds_per_update(update_ends(simulate(measured.schedule, compute)))
    charged = seconds_per_update(update_ends(simulate(measured.schedule, costs)))
    assert charged > alone
    assert action_overhead(simulate(measured.schedule, Costs(overhead=1e-5))) == pytest.approx(1e-5)


def _calibration(tmp_path, **values):
    from pipetrain.schedule.costs import machine_facts

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**values, "measured_on": {**machine_facts(), "transport": "gloo"}}))
    return str(path)


def test_an_emulated_run_predicted_with_and_without_a_calibration(tmp_path):
    """prediction() on a real run: without a calibration compute only, with one more (overhead > 0)."""
    from pipetrain.training.emulated import train_emulated
    from pipetrain.training.setup import prepare

    from pipetrain.training.shapes import stage_output_bytes

    run = prepare(TrainConfig(executor="emulate", **SMALL))
    assert stage_output_bytes(run) == [4 * 8 * 4, 4 * 2 * 4]  # microbatch 4 x width 8, then 2 logits, float32
    result = train_emulated(run)
    ends = result.extra["update_seconds"]
    plain = prediction(run, result.timeline, ends)
    assert plain["calibrated"] is False and "calibration" not in plain
    assert plain["simulated_seconds_per_update"] == plain["simulated_compute_only_seconds_per_update"] > 0
    assert plain["measured_seconds_per_update"] == seconds_per_update(list(ends))
    path = _calibration(tmp_path, overhead=1e-4, send=1e-5, recv=1e-5, latency=1e-4, bandwidth=1e8)
    run.config = replace(run.config, costs_file=path)
    calibrated = prediction(run, result.timeline, ends)
    assert calibrated["calibrated"] is True and calibrated["calibration"]["file"] == path
    assert calibrated["simulated_seconds_per_update"] > calibrated["simulated_compute_only_seconds_per_update"]
    assert calibrated["simulated_compute_only_seconds_per_update"] == plain["simulated_compute_only_seconds_per_update"]
    assert calibrated["measured_over_simulated"] == pytest.approx(
        calibrated["measured_seconds_per_update"] / calibrated["simulated_seconds_per_update"])


def test_a_distributed_run_reports_how_well_it_was_predicted(tmp_path):
    from pipetrain.training.train import train

    report = tmp_path / "report.json"
    path = _calibration(tmp_path, overhead=2e-5, send=1e-5, recv=1e-5, latency=5e-5)
    result = train(TrainConfig(executor="distributed", costs_file=path, report_json=str(report), **SMALL))
    data = json.loads(report.read_text())
    assert data["calibrated"] is True and data["calibration"]["measured_on"]["transport"] == "gloo"
    assert data["measured_seconds_per_update"] == pytest.approx(seconds_per_update(data["update_seconds"]))
    assert data["simulated_seconds_per_update"] > data["simulated_compute_only_seconds_per_update"] > 0
    assert data["measured_over_simulated"] == pytest.approx(
        data["measured_seconds_per_update"] / data["simulated_seconds_per_update"])
    assert result.extra["calibrated"] is True


def test_the_emulator_reports_no_prediction():
    """Its ranks take turns in one process: the simulator's parallel time does not describe it."""
    from pipetrain.training.train import train

    result = train(TrainConfig(executor="emulate", **SMALL))
    assert "simulated_seconds_per_update" not in result.report()


@pytest.mark.parametrize("content, hint", [('{"overhead": "fast"}', "overhead must be a number"),
                                           ('{"latency": -1}', "latency must be non-negative"),
                                           ('{"speed": 1}', "unknown key 'speed'"), ("{", "not valid JSON")])
def test_a_malformed_calibration_is_refused_before_the_run_naming_the_field(tmp_path, content, hint):
    from pipetrain.training.validate import check_config

    path = tmp_path / "calibration.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"costs_file.*{hint}"):
        check_config(TrainConfig(costs_file=str(path), **SMALL))


def test_a_calibration_from_elsewhere_is_used_with_a_warning(tmp_path):
    from pipetrain.training.prediction import load_calibration
    from pipetrain.training.validate import check_config

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"overhead": 1e-5, "measured_on": {"host": "elsewhere", "torch": "0.1"}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_config(TrainConfig(costs_file=str(path), **SMALL))  # accepted before the run, quietly
    with pytest.warns(UserWarning, match="measured on host elsewhere, torch 0.1"):
        assert load_calibration(str(path)).overhead == 1e-5
