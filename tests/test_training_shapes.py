"""The first training microbatch and the first held-out batch run through the stages and the loss
on the meta device at set-up (`pipetrain.training.shapes`): a batch the model cannot take, a
forward or a loss that raises on it, a loss that is not one number, are refused in one line
before any training, and nothing is written; what the meta device cannot run is not refused."""

from __future__ import annotations

import os
import textwrap

import pytest

from pipetrain.cli import main

NETS = textwrap.dedent('''
    import torch
    from torch import nn


    class Picky(nn.Module):
        def forward(self, x):
            if x.shape[-1] != 12:
                raise ValueError(f"Picky takes 12 features, got {x.shape[-1]}")
            return x


    class ByValue(nn.Module):
        def forward(self, x):
            return x if x.sum() > -1e9 else -x  # reads a value: the meta device cannot say


    def net(in_features, num_classes, middle="none"):
        torch.manual_seed(0)
        inner = {"none": nn.Identity(), "picky": Picky(), "by_value": ByValue()}[middle]
        return nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), inner, nn.Linear(16, num_classes))


    def raising_loss(output, target):
        raise KeyError("no such loss")


    def per_sample_loss(output, target):
        return nn.functional.cross_entropy(output, target, reduction="none")


    def with_loss(in_features, num_classes, loss):
        model = net(in_features, num_classes)
        model.pipeline_loss = {"raising": raising_loss, "per_sample": per_sample_loss}[loss]
        return model
''')

DATA = "synthetic:features=8,classes=3,samples=64"


@pytest.fixture
def nets(tmp_path, monkeypatch):
    (tmp_path / "shapenets.py").write_text(NETS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train(capsys, tmp_path, *argv, executor="emulate"):
    outputs = ["--save", str(tmp_path / "out" / "m.pt"), "--report-json", str(tmp_path / "out" / "r.json")]
    code = main(["train", "--data", DATA, "--batch-size", "8", "--steps", "2", "--balance", "2,2", "--no-progress",
                 "--executor", executor, *outputs, *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--model", "shapenets:net", "--test-data", "synthetic:features=12,classes=3,samples=64"],
     "error: at set-up (on the meta device), on the first held-out batch, stage 0 cannot run on its input "
     "((64, 12) float32) from the data: RuntimeError: "),
    (["--model", "shapenets:net:middle=picky"],
     "error: at set-up (on the meta device), on the first training microbatch, the forward of stage 1 raised "
     "ValueError: Picky takes 12 features, got 16 (shapenets.py:9, in forward) in module '2' (Picky)"),
    (["--model", "shapenets:with_loss:loss=raising"],
     "error: at set-up (on the meta device), on the first training microbatch, the loss of stage 1 raised "
     "KeyError: 'no such loss' (shapenets.py:25, in raising_loss)"),
    (["--model", "shapenets:with_loss:loss=per_sample"],
     "the loss of stage 1 returned a (2,) tensor, not one number: return its mean over the samples "
     "(reduction='mean'"),
    (["--model", "mlp:depth=3,width=16", "--init", "meta", "--test-data", "synthetic:features=12,classes=3,samples=64"],
     "on the first held-out batch, stage 0 cannot run on its input ((64, 12) float32) from the data"),
])
def test_a_batch_the_model_cannot_take_is_refused_at_set_up_in_one_line(capsys, nets, argv, message):
    code, out, err = _train(capsys, nets, *argv)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == "" and not (nets / "out").exists()  # refused before the run's first line: nothing trained


def test_the_distributed_runtime_refuses_before_starting_a_worker(capsys, nets):
    code, out, err = _train(capsys, nets, "--model", "shapenets:net", "--test-data",
                            "synthetic:features=12,classes=3,samples=64", executor="distributed")
    assert code == 2 and "on the first held-out batch, stage 0 cannot run on its input" in err, err
    assert "pipetrain launch" not in err and not (nets / "out").exists()


def test_what_the_meta_device_cannot_run_is_left_to_the_run(capsys, nets):
    code, out, err = _train(capsys, nets, "--model", "shapenets:net:middle=by_value")
    assert code == 0, err
    assert os.path.exists(nets / "out" / "m.pt")


def test_fit_refuses_held_out_targets_the_loss_cannot_take_before_any_update():
    import torch
    from torch import nn

    from pipetrain import Pipeline
    from pipetrain.errors import PipetrainError

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    held_out = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64, 2)))
    pipe = Pipeline(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), balance=[2, 1], executor="emulate")
    updates = []
    with pytest.raises(PipetrainError, match=r"^at set-up \(on the meta device\), on the first held-out batch, the "
                                             r"loss of stage 1: cross entropy needs logits with one more dimension"):
        pipe.fit(data, batch_size=8, steps=2, eval_data=held_out, callbacks=[lambda step, loss: updates.append(step)],
                 progress=False, quiet=True)
    assert updates == []
