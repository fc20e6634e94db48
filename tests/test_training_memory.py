"""The report's peak memory per stage, beside the memory model's prediction."""

from __future__ import annotations

import json

import pytest
import torch

from pipetrain.cli import main
from pipetrain.schedule import memory_by_rank
from pipetrain.training.memory_report import MemoryProbe

SMALL = ["--model", "mlp:depth=3,width=16", "--data", "synthetic:features=8,classes=3,samples=64",
         "--batch-size", "8", "--steps", "4", "--no-progress", "--quiet", "--executor", "emulate"]


def test_the_cpu_probe_reads_the_peak_resident_size():
    probe = MemoryProbe(torch.device("cpu"))
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB touched
    figures = probe.read()
    assert figures["measure"] == "peak_rss" and figures["device"] == "cpu"
    assert figures["peak_bytes"] >= figures["start_bytes"] + block.numel() // 2


@pytest.mark.parametrize("recompute", ["none", "stage", "stage:1"])
def test_the_report_holds_measured_and_predicted_memory_per_stage(capsys, tmp_path, recompute):
    report_path = tmp_path / "report.json"
    assert main(["train", *SMALL, "--schedule", "gpipe", "--stages", "3", "--microbatches", "4",
                 "--recompute", recompute, "--report-json", str(report_path)]) == 0
    memory = json.loads(report_path.read_text())["memory"]
    assert memory["measure"] == "peak_rss" and memory["recompute"] == recompute
    stages = memory["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2]
    assert all(s["peak_bytes"] >= s["start_bytes"] > 0 for s in stages)
    if recompute == "none":  # GPipe holds every microbatch's activations
        assert [s["predicted_peak_activations"] for s in stages] == [4, 4, 4]
        assert all("predicted_peak_inputs" not in s for s in stages)
    elif recompute == "stage":  # only the inputs, and one graph at a time
        assert [s["predicted_peak_activations"] for s in stages] == [1, 1, 1]
        assert [s["predicted_peak_inputs"] for s in stages] == [4, 4, 4]
    else:  # stage 1 alone
        assert [s["predicted_peak_activations"] for s in stages] == [4, 1, 4]
        assert [s.get("predicted_peak_inputs") for s in stages] == [None, 4, None]
    assert [s["predicted_peak_versions"] for s in stages] == [1, 1, 1]


def test_pipedreams_prediction_is_the_memory_model_of_its_schedule(tmp_path):
    from pipetrain.schedule import build

    report_path = tmp_path / "report.json"
    assert main(["train", *SMALL, "--schedule", "pipedream", "--stages", "3", "--report-json", str(report_path)]) == 0
    stages = json.loads(report_path.read_text())["memory"]["stages"]
    model = memory_by_rank(build("pipedream", 3, 4))
    assert [s["predicted_peak_versions"] for s in stages] == [model[s].peak_versions[s] for s in range(3)] == [3, 2, 1]


def test_a_run_fed_by_step_reports_its_memory_too():
    from torch import nn

    from pipetrain import Pipeline

    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), balance=[2, 1], schedule="gpipe",
                    microbatches=2, executor="emulate", recompute="stage")
    pipe.start(steps=2, batch_size=4)
    for _ in range(2):
        pipe.step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
    memory = pipe.finish().extra["memory"]
    assert [s["predicted_peak_inputs"] for s in memory["stages"]] == [2, 2]
    assert all(s["peak_bytes"] > 0 for s in memory["stages"])
