"""`pipetrain plan`: table, JSON, files and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.plan.stage_memory import SCHEDULES
from pipetrain.cli import main

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"
VGG = str(PROFILES / "vgg16.txt")


def run(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_contract_fields(capsys):
    code, out, err = run(capsys, VGG, "--workers", "16", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)          # exactly one JSON object
    assert data["predicted_time_per_minibatch"] == pytest.approx(0.056529767, rel=1e-6)
    assert data["replicas"] == [13, 2, 1]
    assert len(data["stages"]) == data["num_stages"] == 3
    assert 0 <= data["solve_seconds"] < 5
    assert data["noam"] == 2 and data["schedule"] == "pipedream"
    assert {b["method"] for b in data["baselines"]} == \
        {"uniform", "balanced-by-parameters", "balanced-by-time"}


def chain_profile(path: Path, layers: int = 120) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    path.write_text(json.dumps({"format": "pipetrain-profile", "version": 1, "layers": [
        {"name": f"l{i}", "forward_s": float(t) / 3, "backward_s": 2 * float(t) / 3,
         "parameter_bytes": float(p), "activation_bytes": float(a)}
        for i, (t, p, a) in enumerate(zip(rng.uniform(1e-3, 1e-2, layers),
                                          rng.uniform(0, 5e7, layers),
                                          rng.uniform(0, 5e6, layers)))]}))
    return str(path)


@pytest.mark.parametrize("argv", [
    ["--workers", "16"],
    ["--workers", "4", "--straight"],
    ["--workers", "8", "--fewer-machines", "--cost-model", "paper"],
    ["--workers", "64", "--topology", "4x4x4", "--bandwidth", "10e9,1e9,1e8"],
    ["--workers", "32", "--topology", "2x16", "--bandwidth", "10e9,1e8", "--fewer-machines"],
    ["--workers", "4", "--memory", "2GB", "--schedule", "auto"],
    ["--workers", "4", "--schedule", "1f1b", "--microbatches", "8"],
])
def test_json_contract_in_every_mode(capsys, tmp_path, argv):
    """The fields `pipetrain plan --json` promises, and what `pipetrain train --plan` reads."""
    out_path = tmp_path / "plan.json"
    code, out, err = run(capsys, chain_profile(tmp_path / "chain.json"), *argv, "--json",
                         "--out", str(out_path))
    assert code == 0 and err == ""
    data = json.loads(out)
    assert json.loads(out_path.read_text()) == data
    workers = int(argv[1])
    assert isinstance(data["predicted_time_per_minibatch"], float)
    assert data["predicted_time_per_minibatch"] > 0
    assert isinstance(data["solve_seconds"], float) and data["solve_seconds"] >= 0
    replicas, stages = data["replicas"], data["stages"]
    assert all(isinstance(r, int) and r >= 1 for r in replicas)
    assert len(replicas) == len(stages) == data["num_stages"] == len(data["balance"])
    assert sum(replicas) == data["workers_used"] * data["chunks"] and data["workers_used"] <= workers
    assert [s["replicas"] for s in stages] == replicas
    assert max(s["time_s"] for s in stages) <= data["predicted_time_per_minibatch"] * (1 + 1e-9)
    assert sum(len(s["layers"]) for s in stages) == sum(data["balance"]) == 120
    assert data["schedule"] in SCHEDULES
    assert isinstance(data["microbatches"], int) and data["microbatches"] >= 1


def test_hierarchical_and_straight(capsys):
    code, out, _ = run(capsys, VGG, "--workers", "16", "--topology", "4x4", "--bandwidth",
                       "10e9,1.25e9", "--json")
    data = json.loads(out)
    assert code == 0 and sum(data["replicas"]) == 16
    assert data["predicted_time_per_minibatch"] == pytest.approx(0.067133997, rel=1e-6)
    code, out, _ = run(capsys, VGG, "--workers", "4", "--straight", "--json")
    assert json.loads(out)["replicas"] == [1, 1, 1, 1]


def test_paper_cost_model_and_bandwidth_flat(capsys):
    code, out, _ = run(capsys, VGG, "--workers", "4", "--bandwidth", "2e9",
                       "--cost-model", "paper", "--json", "--no-baselines")
    data = json.loads(out)
    assert code == 0 and data["cost_model"] == "paper" and data["baselines"] == []


def test_table_files_and_plot(capsys, tmp_path):
    out_path, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code, out, _ = run(capsys, str(PROFILES / "resnet18.txt"), "--workers", "8", "--out",
                       str(out_path), "--plot", str(png))
    assert code == 0
    assert "predicted time per minibatch" in out and "balanced-by-time" in out
    assert json.loads(out_path.read_text())["replicas"] == [5, 3]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_schedule_auto_under_memory(capsys):
    code, out, _ = run(capsys, VGG, "--workers", "4", "--memory", "12GB", "--schedule", "auto",
                       "--json")
    data = json.loads(out)
    assert code == 0
    assert data["peak_memory_bytes"] <= 12e9
    tried = {c["schedule"] for c in data["schedule_candidates"]}
    assert tried == set(SCHEDULES)


@pytest.mark.parametrize("argv,match", [
    (["--workers", "8", "--topology", "4x4"], "topology 4x4 has 16 workers"),
    (["--workers", "4", "--memory", "1GB"], "smallest memory limit that fits is"),
    (["--workers", "4", "--memory", "100MB", "--schedule", "auto"],
     "smallest memory limit that fits"),
    (["--workers", "4", "--schedule", "wavy"], "unknown schedule"),
    (["--workers", "64", "--straight"], "straight pipeline over 64 workers"),
])
def test_errors_exit_2_with_one_message(capsys, argv, match):
    code, out, err = run(capsys, VGG, *argv)
    assert code == 2 and out == ""
    assert err.startswith("pipetrain plan: error:") and match in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_profile_error(capsys, tmp_path):
    bad = tmp_path / "graph.txt"
    bad.write_text("node1 -- A -- forward_compute_time=1\n")
    code, _, err = run(capsys, str(bad), "--workers", "2")
    assert code == 2 and "line 1" in err


def test_recompute_auto_chooses_stages_and_train_takes_them(capsys, tmp_path):
    """`pipetrain plan --recompute auto --memory` names the stages that recompute (table and
    JSON); `pipetrain train --plan` recomputes those, unless --recompute says otherwise."""
    from pipetrain.plan.profile_files import save_profile
    from test_plan_planner import blocks

    profile = tmp_path / "blocks.json"
    save_profile(blocks(), profile)
    code, out, err = run(capsys, str(profile), "--workers", "4", "--schedule", "1f1b", "--microbatches", "4",
                         "--memory", "600", "--no-baselines")
    assert code == 2 and "--recompute auto" in err
    code, out, err = run(capsys, str(profile), "--workers", "4", "--schedule", "1f1b", "--microbatches", "4",
                         "--memory", "600", "--recompute", "auto", "--no-baselines", "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    assert out.count("recomputing (+2.000000 s)") == 3
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["recompute_stages"] == [0, 1, 2] and data["recompute"] == "auto"
    code, out, err = run(capsys, str(profile), "--workers", "4", "--recompute", "auto")
    assert code == 2 and "give --memory" in err
    code, out, err = run(capsys, str(profile), "--workers", "4", "--topology", "2x2", "--memory", "600",
                         "--recompute", "auto")
    assert code == 2 and "one flat level" in err
    code, out, err = run(capsys, str(profile), "--workers", "4", "--schedule", "zb-h1", "--memory", "600",
                         "--recompute", "auto")
    assert code == 2 and "not planned under zb-h1" in err

    from pipetrain.training import TrainConfig
    from pipetrain.training.setup import prepare

    base = dict(model="mlp:depth=7,width=8", data="synthetic:features=4,classes=2,samples=32", batch_size=8,
                steps=1, executor="emulate", progress=False, plan=str(tmp_path / "p.json"))
    assert prepare(TrainConfig(**base)).recompute == {0, 1, 2}
    assert prepare(TrainConfig(**base, recompute="none")).recompute == frozenset()
    assert prepare(TrainConfig(**base, recompute="stage:3")).recompute == {3}
