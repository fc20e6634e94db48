"""Mixed precision (``--precision bf16``): autocast in every stage's forward with float32 master
weights, trained on CPU; the runtime equals the emulator under it (fp16: tests/test_training_fp16.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain import Pipeline
from pipetrain.cli import main
from pipetrain.errors import ConfigError
from pipetrain.execution import StageExecutor
from pipetrain.optim import SGD
from pipetrain.training import TrainConfig


def test_a_bf16_stage_sends_bf16_activations_and_keeps_float32_weights_and_gradients():
    torch.manual_seed(0)
    executor = StageExecutor(1, nn.Sequential(nn.Linear(6, 8), nn.Tanh()), SGD(lr=0.1), autocast=torch.bfloat16)
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    out = executor.forward(0, 0, x)[0]
    assert out.dtype == torch.bfloat16
    grad_in = executor.backward(0, 0, (torch.ones(4, 8, dtype=torch.bfloat16),))[0]
    assert grad_in.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in executor.grads.values())
    executor.step()
    assert all(t.dtype == torch.float32 for t in executor.versions.latest.values())
    # the last stage's loss is float32 (autocast computes cross entropy in float32)
    last = StageExecutor(1, nn.Linear(6, 3), None, loss_fn=F.cross_entropy, autocast=torch.bfloat16)
    assert last.forward(0, 0, x, target=torch.tensor([0, 1, 2, 0]))[0].dtype == torch.float32


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(3, 8, generator=g) * 2
    out = []
    for _ in range(steps):
        y = torch.randint(0, 3, (16,), generator=g)
        out.append((centers[y] + torch.randn(16, 8, generator=g), y))
    return out


def test_bf16_trains_on_the_cpu_close_to_fp32():
    losses = {}
    for precision in ("fp32", "bf16"):
        model = _model()
        pipe = Pipeline(model, balance=[3, 2], schedule="1f1b", microbatches=2, optimizer="sgd:lr=0.1,momentum=0.9",
                        executor="emulate", precision=precision)
        losses[precision] = pipe.train(_batches(40))
        assert all(p.dtype == torch.float32 for p in model.parameters())
    bf16, fp32 = losses["bf16"], losses["fp32"]
    assert sum(bf16[-5:]) / 5 < 0.5 * sum(bf16[:5]) / 5  # it learns
    assert bf16 != fp32  # it is not float32 arithmetic ...
    assert abs(sum(bf16[-5:]) - sum(fp32[-5:])) / 5 < 0.1  # ... but trains as well


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_bf16_with_recomputation_is_bitwise_the_same(schedule):
    params = []
    for recompute in ("none", "stage"):
        model = _model()
        data = _batches(4) if schedule != "pb" else [(x[i:i + 1], y[i:i + 1]) for x, y in _batches(2) for i in range(8)]
        Pipeline(model, balance=[2, 2, 1], schedule=schedule, microbatches=2 if schedule != "pb" else 1,
                 optimizer="sgd:lr=0.1,momentum=0.9", executor="emulate", precision="bf16",
                 recompute=recompute).train(data)
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_the_runtime_equals_the_emulator_under_bf16(tmp_path):
    from distributed_parity import assert_distributed_equals_emulated

    base = dict(model="gpt:n_layer=2,n_head=2,n_embd=16", data="text:block_size=8,min_length=4", batch_size=8,
                steps=3, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, quiet=True, stages=2, timeout=60.0,
                precision="bf16", executor="distributed")
    configs = [TrainConfig(schedule=name, save=str(tmp_path / f"{name}-distributed.pt"),
                           report_json=str(tmp_path / f"{name}.json"), **base) for name in ("1f1b", "pipedream")]
    assert_distributed_equals_emulated(configs, 2, timeout=180)
    fp32 = dataclasses.replace(configs[0], executor="emulate", precision="fp32", save=str(tmp_path / "fp32.pt"),
                               report_json=None)
    from pipetrain.training.train import train

    train(fp32)
    a, b = torch.load(fp32.save), torch.load(configs[0].save)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # bf16 really ran
    report = json.loads((tmp_path / "1f1b.json").read_text())  # the runtime's peak memory, per stage
    assert [s["ranks"] for s in report["memory"]["stages"]] == [[0], [1]]
    assert all(s["peak_bytes"] > 0 for s in report["memory"]["stages"])


def test_a_float64_model_is_refused_under_bf16_and_fp16(capsys):
    assert main(["train", "--executor", "emulate", "--precision", "fp16", "--dtype", "float64"]) == 2
    assert "float32 master weights" in capsys.readouterr().err
    assert main(["train", "--executor", "emulate", "--precision", "bf16", "--dtype", "float64"]) == 2
    assert "float32 master weights" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="float32 model"):
        Pipeline(_model().double(), balance=[3, 2], precision="bf16", executor="emulate").train(
            [(torch.randn(4, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long))])
