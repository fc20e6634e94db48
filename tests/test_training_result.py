"""A run's result holds its per-update figures as arrays (8 bytes an update) and still reports them
as lists: ``update_losses``, ``report()`` and the ``--report-json`` file, written from the arrays,
are exactly what lists of floats give (json.dump's text, byte for byte)."""

from __future__ import annotations

import json
import math
import pickle
from array import array

from pipetrain.training import TrainConfig
from pipetrain.training.result import TrainResult, write_json_atomic
from pipetrain.training.train import train


def _result(losses, **extra) -> TrainResult:
    return TrainResult(schedule="pipedream", stages=2, workers=2, executor="distributed", updates=len(losses),
                       samples=4 * len(losses), seconds=1.5, losses=losses, stage_busy=[1.0, 1.25],
                       stage_idle=[0.5, 0.25], evaluations=[{"step": 3, "loss": 0.5, "accuracy": 0.75}], extra=extra)


def test_the_losses_are_an_array_and_listed_where_asked_for():
    losses = [0.5, 0.25, float("nan"), 0.125]
    result = _result(losses)
    assert isinstance(result.losses, array) and result.losses.typecode == "d"
    listed = result.update_losses
    assert type(listed) is list and listed[:2] == [0.5, 0.25] and math.isnan(listed[2]) and listed[3] == 0.125
    assert result.final_loss == 0.125
    assert type(result.report()["losses"]) is list
    assert math.isnan(_result([]).final_loss) and _result([]).update_losses == []


def test_the_report_file_is_json_dump_of_the_listed_report(tmp_path):
    n = 10_000  # more than one slice of the writer
    losses = array("d", (1.0 / (t + 1) for t in range(n)))
    losses[7] = float("nan")
    losses[8], losses[9] = float("inf"), -float("inf")
    ends = array("d", (0.001 * t for t in range(n)))
    result = _result(losses, units_per_update=1, update_seconds=ends, empty=array("d"), steps_seen=array("q", [1, 2]),
                     stage_choice={"sizes": [3, 4], "note": "ünïcode \"quoted\"\nline", 5: {"nested": [1.5]}},
                     skipped_updates=[[], [4]])
    path = tmp_path / "report.json"
    result.write_report(str(path))
    expected = json.dumps(result.report(), indent=1) + "\n"
    assert path.read_text(encoding="utf-8") == expected
    assert json.loads(expected)["losses"][:2] == [1.0, 0.5]
    write_json_atomic(str(path), [1, {"a": None}])  # anything else: json.dump's text
    assert path.read_text() == json.dumps([1, {"a": None}], indent=1) + "\n"
    write_json_atomic(str(path), {})
    assert path.read_text() == "{}\n"


def test_a_run_hands_on_and_pickles_its_per_update_figures_compactly(tmp_path):
    report = tmp_path / "report.json"
    config = TrainConfig(schedule="pipedream", stages=2, model="mlp:depth=2,width=8",
                         data="synthetic:features=6,classes=2,samples=32", batch_size=2, steps=40, progress=False,
                         quiet=True, executor="emulate", report_json=str(report))
    result = train(config)
    assert isinstance(result.losses, array) and len(result.losses) == 40
    assert isinstance(result.extra["update_seconds"], array) and len(result.extra["update_seconds"]) == 40
    assert result.update_losses == list(result.losses)
    with open(report, encoding="utf-8") as handle:
        written = handle.read()
    assert written == json.dumps(result.report(), indent=1) + "\n"
    assert json.loads(written)["losses"] == result.update_losses
    # what every rank of a distributed run receives (the result less its timeline): 8 bytes an update
    assert len(pickle.dumps(result.losses)) < 8 * 40 + 100
    shared = pickle.loads(pickle.dumps(_result(result.losses)))
    assert isinstance(shared.losses, array) and shared.update_losses == result.update_losses
