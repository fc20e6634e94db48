"""A diverging run, or NaNs in the data, stops with the step and stage named, on the emulator and the
distributed runtime, and writes nothing; `--on-nonfinite skip` skips exactly those updates."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from pipetrain.cli import main

SMALL = ["--model", "mlp:depth=3,width=16", "--batch-size", "8", "--no-progress", "--no-shuffle",
         "--stages", "2", "--timeout", "30"]
SYNTHETIC = ["--data", "synthetic:features=8,classes=3,samples=64"]

# sample 20 holds a NaN: with batches of 8 in order it is in update 3 (counted from 1)
NAN_DATA = textwrap.dedent('''
    import torch
    from torch.utils.data import TensorDataset

    def with_nan(split="train", index=20):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
        if split == "train":
            x[index, 3] = float("nan")
        return TensorDataset(x, y)
''')


@pytest.fixture
def nan_data(tmp_path, monkeypatch):
    (tmp_path / "nandata.py").write_text(NAN_DATA)
    monkeypatch.chdir(tmp_path)
    return ["--data", "nandata:with_nan"]


def train(capfd, *argv):
    code = main(["train", *argv])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("executor", ["emulate", "distributed"])
def test_nan_in_the_data_stops_at_its_step_on_the_last_stage(capfd, tmp_path, nan_data, executor):
    saved = tmp_path / "model.pt"
    code, out, err = train(capfd, *SMALL, *nan_data, "--steps", "6", "--executor", executor, "--save", str(saved))
    assert code == 2, err
    # 4 microbatches of 2 samples per update: sample 20 is in microbatch 10, of update 3
    assert ("step 3, stage 1 on rank 1 (1F10@v2): the loss of microbatch 10 is nan (its input from stage 0 already "
            "holds nan)") in err
    assert "Traceback" not in err and "status of every rank" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not saved.exists()


@pytest.mark.parametrize("executor", ["emulate", "distributed"])
def test_a_diverging_learning_rate_stops_naming_the_step_and_stage(capfd, tmp_path, executor):
    report = tmp_path / "report.json"
    code, out, err = train(capfd, *SMALL, *SYNTHETIC, "--optimizer", "sgd:lr=1e6", "--steps", "20",
                           "--executor", executor, "--report-json", str(report))
    assert code == 2, err
    assert "pipetrain train: error: step " in err and ", stage 1 on rank 1 " in err and " is nan" in err
    assert "lower lr in --optimizer" in err
    assert not report.exists() and "samples/s" not in out  # no final line: nothing came of the run


def _plain_training_skipping_updates_whose_gradient_is_not_finite(steps: int) -> dict[str, torch.Tensor]:
    """What --on-nonfinite skip must compute for 1f1b with one microbatch: plain PyTorch training that
    leaves out the update whose gradient is not finite (weights and momentum as they were)."""
    import nandata
    from pipetrain.models import build_model

    model = build_model("mlp:depth=3,width=16", input_shape=(8,), num_classes=3, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, foreach=False)
    x, y = nandata.with_nan().tensors
    for t in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[8 * t: 8 * t + 8]), y[8 * t: 8 * t + 8]).backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            optimizer.step()
    return model.state_dict()


def test_skip_on_a_synchronous_schedule_equals_plain_training_without_that_update(capfd, tmp_path, nan_data):
    saved, report = tmp_path / "model.pt", tmp_path / "report.json"
    code, out, err = train(capfd, *SMALL, *nan_data, "--steps", "6", "--schedule", "1f1b", "--microbatches", "1",
                           "--executor", "emulate", "--on-nonfinite", "skip", "--save", str(saved),
                           "--report-json", str(report))
    assert code == 0, err
    assert "skipped updates whose gradient was not finite (--on-nonfinite skip): stage 0: step 3; stage 1: step 3" in out
    assert json.loads(report.read_text())["skipped_updates"] == [[3], [3]]
    expected = _plain_training_skipping_updates_whose_gradient_is_not_finite(6)
    state = torch.load(saved)
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def test_skip_on_pipedream_skips_the_same_update_on_every_stage_and_the_runtime_equals_the_emulator(
        capfd, tmp_path, nan_data):
    results = {}
    for executor in ("emulate", "distributed"):
        saved, report = tmp_path / f"{executor}.pt", tmp_path / f"{executor}.json"
        code, out, err = train(capfd, *SMALL, *nan_data, "--steps", "8", "--schedule", "pipedream",
                               "--executor", executor, "--on-nonfinite", "skip", "--save", str(saved),
                               "--report-json", str(report))
        assert code == 0, err
        results[executor] = (torch.load(saved), json.loads(report.read_text()))
    (emulated, emulated_report), (distributed, distributed_report) = results["emulate"], results["distributed"]
    # minibatch 2 (samples 16-23) is update 3 of every stage; its gradient is NaN everywhere
    assert emulated_report["skipped_updates"] == distributed_report["skipped_updates"] == [[3], [3]]
    for name, value in emulated.items():
        assert torch.isfinite(value).all() and torch.equal(distributed[name], value), name


HUGE_DATA = textwrap.dedent('''
    import torch
    from torch.utils.data import TensorDataset

    def huge(split="train"):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        return TensorDataset(torch.randn(64, 8, generator=g) * 1e20, torch.randint(0, 3, (64,), generator=g))
''')


def test_no_checkpoint_holds_weights_that_are_not_finite(capfd, tmp_path, monkeypatch):
    # inputs of 1e20 give a finite loss (about 1e21) and gradient (about 1e20), but lr 1e20 makes the
    # weights of the first update infinite: the checkpoint after it is refused, before any loss sees them
    (tmp_path / "hugedata.py").write_text(HUGE_DATA)
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "checkpoints"
    code, out, err = train(capfd, "--model", "mlp:depth=1,width=16", "--data", "hugedata:huge", "--batch-size", "8",
                           "--stages", "2", "--optimizer", "sgd:lr=1e20", "--steps", "6", "--no-progress",
                           "--timeout", "30", "--checkpoint-dir", str(directory), "--checkpoint-every", "1")
    assert code == 2, err
    assert "the weights after update 1 are not finite in" in err and "no checkpoint was written" in err, err
    assert ", stage " in err and err.count("rank ") >= 1 and len(err.strip().splitlines()) == 1
    assert not list(directory.glob("step-*/manifest.json"))


def test_the_python_api_stops_or_skips_the_same_way():
    from torch import nn

    from pipetrain import Pipeline
    from pipetrain.errors import NonFiniteError

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    x[20, 3] = float("nan")  # in the third batch of 8
    data = torch.utils.data.TensorDataset(x, y)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    stopping = Pipeline(model(), balance=[2, 1], schedule="1f1b", executor="emulate")
    with pytest.raises(NonFiniteError, match=r"^step 3, stage 1 on rank 1 \(1F10@v2\): the loss of microbatch 10 is nan"):
        stopping.fit(data, batch_size=8, steps=4, shuffle=False)
    skipping = Pipeline(model(), balance=[2, 1], schedule="1f1b", executor="emulate", on_nonfinite="skip")
    result = skipping.fit(data, batch_size=8, steps=4, shuffle=False)
    assert result.extra["skipped_updates"] == [[3], [3]]
    assert all(torch.isfinite(p).all() for p in skipping.model.parameters())
