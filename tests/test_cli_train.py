"""`pipetrain train`: reports and outputs, and one clear message (exit 2) for each bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pipetrain.cli import main

SMALL = ["--model", "mlp:depth=3,width=16", "--data", "synthetic:features=8,classes=3,samples=64",
         "--batch-size", "8", "--no-progress"]


def run(capsys, *argv):
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_emulated_training_writes_every_output(capsys, tmp_path):
    paths = {name: tmp_path / name for name in ("model.pt", "report.json", "trace.json", "plot.png")}
    code, out, err = run(capsys, "--executor", "emulate", *SMALL, "--schedule", "1f1b", "--stages", "2",
                         "--steps", "6", "--eval-every", "3", "--save", str(paths["model.pt"]),
                         "--report-json", str(paths["report.json"]), "--trace", str(paths["trace.json"]),
                         "--plot", str(paths["plot.png"]))
    assert code == 0, err
    assert "test accuracy" in out
    report = json.loads(paths["report.json"].read_text())
    for key in ("samples_per_s", "final_loss", "steps", "schedule", "stages", "workers",
                "stage_busy_seconds", "stage_idle_seconds"):
        assert key in report
    assert report["steps"] == 6 and report["schedule"] == "1f1b" and report["stages"] == 2
    assert [e["step"] for e in report["evaluations"]] == [3, 6]
    state = torch.load(paths["model.pt"])
    assert "0.0.weight" in state
    assert paths["plot.png"].stat().st_size > 10_000
    events = json.loads(paths["trace.json"].read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # measured and simulated


BAD_MODULE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    def with_batchnorm(in_features, num_classes):
        return nn.Sequential(nn.Linear(in_features, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, num_classes))

    def mismatched(in_features, num_classes):
        return [nn.Sequential(nn.Linear(in_features, 32), nn.ReLU()), nn.Linear(16, num_classes)]

    class Named(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.zeros(8), "cat"  # a label by name, not by class number
''')


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "pb", "--model", "badnets:with_batchnorm", "--stages", "2", "--batch-size", "1"],
         "BatchNorm"),
        (["--model", "mlp:depth=1", "--stages", "5"], "stages"),
        (["--model", "mlp:depth=3", "--balance", "1,1"], "balance"),
        (["--optimizer", "sgd:lr=0.1,momentun=0.9", "--stages", "2"], "momentum"),
        (["--optimizer", "rmsprop:lr=0.1", "--stages", "2"], "sgd"),
        (["--model", "nosuch.nets:make", "--stages", "2"], "cannot import module 'nosuch.nets'"),
        (["--model", "badnets:mismatched", "--stages", "2"], "stage 1 cannot run on its input ((2, 32) float32) from stage 0"),
        (["--stages", "2", "--workers", "3"], "--workers 3 does not match"),
        (["--stages", "2", "--batch-size", "100"], "--batch-size 100 is more than the 64 training samples: every "
         "update would read the data 1.56 times over"),
        (["--stages", "2", "--data", "badnets:Named"], "y must be a target the loss can take: a tensor (class "
             "labels, regression values, ...), a number, or a tuple, list or dict of tensors; got str 'cat'"),
        (["--schedule", "zb-h3", "--stages", "2"], "unknown schedule"),
        (["--stages", "2", "--checkpoint-every", "2"], "checkpoints are written by the distributed runtime"),
        (["--schedule", "pipedream", "--stages", "2", "--replicas", "2,1", "--steps", "8", "--eval-every", "3"],
         "--eval-every 3 would pause the run in the middle of an update that the replicas of a stage make together"),
    ],
)
def test_bad_input_gets_one_clear_message(capsys, tmp_path, monkeypatch, argv, message):
    (tmp_path / "badnets.py").write_text(BAD_MODULE)
    monkeypatch.chdir(tmp_path)
    options = ["--data", "synthetic:features=8,classes=3,samples=64", "--batch-size", "8", "--steps", "2",
               "--no-progress", "--executor", "emulate"]
    code, out, err = run(capsys, *options, *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


def test_distributed_shape_mismatch_names_the_stages(tmp_path):
    (tmp_path / "badnets.py").write_text(BAD_MODULE)
    result = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "train", "--model", "badnets:mismatched", "--stages", "2",
         "--data", "synthetic:features=8,classes=3,samples=64", "--batch-size", "8", "--steps", "2",
         "--no-progress", "--timeout", "20"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path])),
    )
    assert result.returncode != 0
    assert "stage 1 cannot run on its input ((2, 32) float32) from stage 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_from_a_plan(capsys, tmp_path):
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", "--model", "mlp:depth=3,width=16", "--data", "synthetic:features=8,classes=3,samples=64",
                 "--batch-size", "8", "--iterations", "2", "--warmup", "1", "--out", str(profile)]) == 0
    assert main(["plan", str(profile), "--workers", "2", "--straight", "--out", str(plan)]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, "--executor", "emulate", *SMALL, "--plan", str(plan), "--steps", "4",
                         "--report-json", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workers"] == 2 and report["stages"] == 2
    code, out, err = run(capsys, "--executor", "emulate", *SMALL, "--plan", str(plan), "--balance", "2,2")
    assert code == 2 and "the plan decides" in err


TRACING = '''
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.l = nn.Linear(width, width)

    def forward(self, x):
        if x.mean() > 0:  # control flow on a value: torch.fx cannot trace it
            return self.l(x)
        return -self.l(x)


class Net(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        self.inp = nn.Linear(in_features, 16)
        self.gate = Gate(16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x, scale=1.0):
        return self.out(self.gate(self.inp(x)) * scale)


def net(in_features, num_classes):
    return Net(in_features, num_classes)
'''


def test_leaf_modules_and_concrete_args_reach_the_tracer(capsys, tmp_path, monkeypatch):
    (tmp_path / "tracenets.py").write_text(TRACING)
    monkeypatch.chdir(tmp_path)
    options = [*SMALL[2:], "--model", "tracenets:net", "--stages", "2", "--steps", "2", "--executor", "emulate"]
    code, out, err = run(capsys, *options)
    assert code == 2 and "--leaf-modules gate" in err and "Traceback" not in err
    for extra in (["--leaf-modules", "gate"], ["--leaf-modules", "Gate", "--concrete-args", "scale=0.5"]):
        report = tmp_path / "report.json"
        code, out, err = run(capsys, *options, *extra, "--split-at", "out", "--report-json", str(report))
        assert code == 0, err
        assert json.loads(report.read_text())["stage_choice"]["split_at"] == ["out"]
    code, out, err = run(capsys, *options, "--leaf-modules", "gate", "--split-at", "gate.l")
    assert code == 2 and "lies inside 'gate'" in err
    with pytest.raises(SystemExit) as info:
        main(["train", *options, "--concrete-args", "scale"])
    assert info.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err


def test_concrete_args_are_baked_into_the_stages(tmp_path, monkeypatch):
    from pipetrain.training import TrainConfig
    from pipetrain.training.setup import prepare

    (tmp_path / "tracenets.py").write_text(TRACING)
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(model="tracenets:net", data="synthetic:features=8,classes=3,samples=64", batch_size=8,
                         steps=1, split_at=["out"], leaf_modules=["gate"], concrete_args={"scale": 0.0},
                         executor="emulate", progress=False)
    run_ = prepare(config)
    x = torch.randn(2, 8)
    assert torch.equal(run_.staged(x), run_.model(x, scale=0.0))
    assert config.fingerprint()["leaf_modules"] == ["gate"] and config.fingerprint()["concrete_args"] == {"scale": 0.0}


RAISING_MODULE = textwrap.dedent('''
    import torch
    from torch.utils.data import Dataset

    def broken_model(in_features, num_classes):
        raise RuntimeError("no such layer config")

    def broken_data():
        raise OSError("the data file is missing")

    class Records(Dataset):
        """A plain data set whose training split's record 37 is corrupt (set-up reads only its first
        microbatch, and the first held-out batch, which is whole)."""
        num_classes = 3

        def __init__(self, split="train"):
            g = torch.Generator().manual_seed(0 if split == "train" else 1)
            self.x, self.y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
            self.corrupt = 37 if split == "train" else None

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            if i == self.corrupt:
                raise ValueError(f"corrupt record {i}")
            return self.x[i], self.y[i]

    class Batched(Records):
        """The same, read a batch at a time (and so ahead of need, on a background thread)."""

        def batch(self, indices):
            if self.corrupt in indices.tolist():
                raise KeyError("record 37")
            return self.x[indices], self.y[indices]
''')


# set-up (in this process, before any worker starts) builds the model and reads sample 0; the other
# samples are read while training: on the distributed runtime by the worker of stage 0
RAISING_CASES = [
    (["--model", "raising:broken_model"], "emulate",
     "model factory raising:broken_model raised RuntimeError: no such layer config (raising.py:6, in broken_model)"),
    (["--data", "raising:broken_data"], "emulate",
     "data factory raising:broken_data raised OSError: the data file is missing (raising.py:9, in broken_data)"),
]
for _executor in ("emulate", "distributed"):
    RAISING_CASES += [
        (["--data", "raising:Records"], _executor,
         "data set Records: reading sample 37 raised ValueError: corrupt record 37 (raising.py:26, in __getitem__)"),
        (["--data", "raising:Batched"], _executor,
         "data set Batched: batch([32, 33, 34, 35, 36, 37, 38, 39]) raised KeyError: 'record 37' (raising.py:34, in batch)"),
    ]


@pytest.mark.parametrize("argv, executor, message", RAISING_CASES)
def test_a_factory_or_data_set_that_raises_is_named_in_one_line(capfd, tmp_path, monkeypatch, argv, executor, message):
    (tmp_path / "raising.py").write_text(RAISING_MODULE)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--batch-size", "8", "--steps", "6", "--no-shuffle", "--no-progress", "--stages", "2",
                 "--model", "mlp:depth=3,width=16", "--timeout", "30", "--executor", executor, *argv])
    out, err = capfd.readouterr()
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("executor", ["emulate", "distributed"])
def test_the_stages_and_each_evaluation_are_printed_without_a_terminal(capfd, executor):
    # pytest's capture is not a terminal: no progress bar, but the lines must come all the same
    code = main(["train", "--executor", executor, *SMALL, "--schedule", "1f1b", "--stages", "2", "--steps", "6",
                 "--eval-every", "2"])
    out, err = capfd.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"1f1b: 2 stages on 2 {'workers' if executor == 'distributed' else 'emulated ranks'}, "
                               "6 updates of 8 samples (4 microbatches each)")
    assert lines[1] == ("data: 64 samples, read by index, ahead on a background thread; held out: the test "
                        "split of synthetic:features=8,classes=3,samples=64 (64 samples)")
    assert lines[2].startswith("stage 0: ") and lines[3].startswith("stage 1: ")
    assert [line.split(":")[0] for line in lines[4:7]] == ["after 2 of 6 updates", "after 4 of 6 updates",
                                                           "after 6 of 6 updates"]
    assert "test accuracy" in lines[7]
    code = main(["train", "--executor", executor, *SMALL, "--stages", "2", "--steps", "6", "--eval-every", "2",
                 "--quiet"])
    out, err = capfd.readouterr()
    assert code == 0 and len(out.splitlines()) == 1, out


def test_the_speed_is_a_real_figure_at_any_size():
    """A large model on a small machine trains below one sample a second: not "0 samples/s"."""
    from pipetrain.commands.train import speed
    from pipetrain.training.result import TrainResult

    def result(samples: int, seconds: float, updates: int = 10) -> TrainResult:
        return TrainResult(schedule="1f1b", stages=4, workers=4, executor="distributed", updates=updates,
                           samples=samples, seconds=seconds, losses=[1.0] * updates, stage_busy=[], stage_idle=[])

    assert speed(result(21500, 10.0)) == "2150 samples/s"
    assert speed(result(43, 10.0)) == "4.3 samples/s"
    assert speed(result(80, 104.0)) == "0.77 samples/s (10.4 s per update)"
