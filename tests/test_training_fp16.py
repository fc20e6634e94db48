"""float16 (``--precision fp16``) with a loss scale every stage agrees on, on CPU autocast: the
scale's impulse behaviour, every stage skipping the same overflowed updates on synchronous and
asynchronous schedules, the runtime equal to the emulator, and training close to float32."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain import Pipeline
from pipetrain.cli import main
from pipetrain.errors import ConfigError, NonFiniteError
from pipetrain.execution import StageExecutor
from pipetrain.execution.scaling import LossScale
from pipetrain.optim import SGD
from pipetrain.training import TrainConfig


def test_the_dynamic_scale_halves_on_overflow_and_doubles_after_n_clean_updates():
    scale = LossScale(1024.0, growth_interval=3)
    seen = []
    for overflow in [True, True, False, False, False, False, True, False, False, False]:
        scale.update(overflow, step=len(seen) + 1)
        seen.append(scale.scale)
    assert seen == [512, 256, 256, 256, 512, 512, 256, 256, 256, 512]
    fixed = LossScale(8.0, dynamic=False)
    fixed.update(True, step=1)
    assert fixed.scale == 8.0
    tiny = LossScale(2.0 ** -24)
    with pytest.raises(NonFiniteError, match="bf16"):
        tiny.update(True, step=1)


def test_a_fp16_stage_stamps_the_scale_and_the_flag_and_unscales_exactly():
    torch.manual_seed(0)
    first = StageExecutor(0, nn.Linear(6, 8), SGD(lr=0.5), autocast=torch.float16, scaler=LossScale(2.0 ** 10))
    last = StageExecutor(1, nn.Linear(8, 3), SGD(lr=0.5), loss_fn=F.cross_entropy, autocast=torch.float16,
                         scaler=LossScale(1.0))  # not stage 0: it takes the stamp from the message
    reference = [nn.Linear(6, 8), nn.Linear(8, 3)]
    for mine, theirs in zip([first, last], reference):
        theirs.load_state_dict(mine.module.state_dict())
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    message = first.forward(0, 0, x)
    assert message[0].dtype == torch.float16 and message[-1].tolist() == [1024.0]  # the stamp after the outputs
    last.forward(0, 0, message, target=y)
    back = last.backward(0, 0)
    assert back[-1].tolist() == [0.0]  # no overflow
    first.backward(0, 0, back)
    # the gradients are 1024 times the loss's (in float16 arithmetic), and the update removes 1024 exactly
    for executor in (first, last):
        grads = executor.grads
        executor.grads = dict(grads)
        expected = {n: g / 1024 for n, g in grads.items()}
        before = {n: t.clone() for n, t in executor.versions.latest.items()}
        executor.step()
        for n, t in executor.versions.latest.items():
            assert torch.equal(t, before[n] - 0.5 * expected[n])
    assert first.scales == last.scales == [1024.0] and first.overflow_skipped == last.overflow_skipped == []


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _batches(steps, size=16):
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(3, 8, generator=g) * 2
    out = []
    for _ in range(steps):
        y = torch.randint(0, 3, (size,), generator=g)
        out.append((centers[y] + torch.randn(size, 8, generator=g), y))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "pipedream", "pb", "gpipe", "interleaved", "2bw"])
def test_an_overflow_is_skipped_by_every_stage_and_the_scale_halves_alike(schedule):
    """A first scale of 2**36 overflows float16's gradients (largest 65504): the first updates are
    skipped on every stage, the scale halves by update until the gradients fit, then training goes on.
    interleaved: 2 workers with 2 virtual stages each (the stamp and the flag pass through both)."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    pb = schedule == "pb"
    data = _batches(40) if not pb else [(x[i:i + 1], y[i:i + 1]) for x, y in _batches(3) for i in range(16)]
    shape = dict(balance=[2, 1, 1, 1], chunks=2) if schedule == "interleaved" else dict(balance=[2, 2, 1])
    pipe = Pipeline(model, **shape, schedule=schedule, microbatches=1 if pb else 4 if schedule == "2bw" else 2, executor="emulate",
                    optimizer="sgd:lr=0.05", precision="fp16", loss_scale_init=2.0 ** 36, loss_scale_growth=1000)
    losses = pipe.train(data)
    report = pipe.last_result.extra["loss_scale"]
    stages = report["per_stage"]
    skipped = stages[0]["skipped"]
    if schedule == "zb-h1":
        # the hard case (docs/gpu.md): an overflow found only in a stage's weight gradient (W, after its
        # input gradient left) is skipped by that stage alone; the report says the stages disagree
        assert all(s["skipped"][:10] == list(range(1, 11)) for s in stages)
        assert not report["stages_agree"] and len({tuple(s["skipped"]) for s in stages}) > 1
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return
    assert report["stages_agree"] and all(s["skipped"] == skipped for s in stages)
    assert all(s["scales"] == stages[0]["scales"] for s in stages)  # every stage used the same scale per update
    assert skipped[:10] == list(range(1, 11)) and len(skipped) < len(data) - 5  # 2**36 halved to a scale that fits
    scales = stages[0]["scales"]
    assert scales[0] == 2.0 ** 36 and all(math.log2(s).is_integer() for s in scales)
    assert all(b <= a for a, b in zip(scales, scales[1:]))  # only halvings (growth after 1000)
    assert len(stages) == (4 if schedule == "interleaved" else 3) and report["replicas_agree"]
    if schedule in ("1f1b", "gpipe", "interleaved"):  # synchronous: update n + 1 runs with the scale halved after n's skip
        assert all(scales[n] == scales[n - 1] / (2 if n in skipped else 1) for n in range(1, len(scales)))
    assert scales[-1] <= 2.0 ** 26
    assert all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # later updates applied


def test_a_skipped_fp16_update_leaves_the_weights_as_plain_training_without_that_batch():
    """Synchronous schedules: the updates skipped on overflow are exactly left out."""
    data = _batches(12)
    model = _model()
    pipe = Pipeline(model, balance=[3, 2], schedule="1f1b", microbatches=2, executor="emulate", optimizer="sgd:lr=0.05",
                    precision="fp16", loss_scale_init=2.0 ** 20)
    pipe.train(data)
    skipped = pipe.last_result.extra["loss_scale"]["per_stage"][0]["skipped"]
    assert skipped and skipped == list(range(1, len(skipped) + 1)) and len(skipped) < len(data)
    kept = [batch for step, batch in enumerate(data, 1) if step not in skipped]
    again = _model()
    scale = 2.0 ** (20 - len(skipped))  # the scale the kept updates ran with
    Pipeline(again, balance=[3, 2], schedule="1f1b", microbatches=2, executor="emulate", optimizer="sgd:lr=0.05",
             precision="fp16", loss_scale=scale).train(kept)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_fp16_trains_close_to_fp32():
    losses = {}
    for precision in ("fp32", "fp16"):
        pipe = Pipeline(_model(), balance=[3, 2], schedule="1f1b", microbatches=2, executor="emulate",
                        optimizer="sgd:lr=0.1,momentum=0.9", precision=precision)
        losses[precision] = pipe.train(_batches(40))
    fp16, fp32 = losses["fp16"], losses["fp32"]
    assert fp16 != fp32
    assert sum(fp16[-5:]) / 5 < 0.5 * sum(fp16[:5]) / 5
    assert abs(sum(fp16[-5:]) - sum(fp32[-5:])) / 5 < 0.1


def test_the_runtime_equals_the_emulator_under_fp16_skips_included(tmp_path):
    from distributed_parity import assert_distributed_equals_emulated

    base = dict(model="gpt:n_layer=2,n_head=2,n_embd=16", data="text:block_size=8,min_length=4", batch_size=8,
                steps=6, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, quiet=True, stages=2, timeout=60.0,
                precision="fp16", loss_scale_init=2.0 ** 22, executor="distributed")
    configs = [TrainConfig(schedule=name, microbatches=1 if name == "pb" else 2,
                           save=str(tmp_path / f"{name}-distributed.pt"),
                           report_json=str(tmp_path / f"{name}.json"), **base) for name in ("1f1b", "pipedream", "pb")]
    assert_distributed_equals_emulated(configs, 2, timeout=240)
    for config in configs:
        report = json.loads((tmp_path / f"{config.schedule}.json").read_text())
        scale = report["extra"]["loss_scale"] if "extra" in report else report["loss_scale"]
        assert scale["stages_agree"]
        assert scale["per_stage"][0]["skipped"]  # the first scale overflowed: skips were part of the parity


def test_the_command_line_reports_the_scale_and_refuses_a_scale_that_is_not_a_power_of_two(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["train", "--executor", "emulate", "--precision", "fp16", "--steps", "3", "--loss-scale-init",
                 str(2 ** 40), "--report-json", str(report), "--quiet", "--no-progress"]) == 0
    assert "fp16 loss scale" in capsys.readouterr().out
    assert "loss_scale" in report.read_text()
    assert main(["train", "--executor", "emulate", "--precision", "fp16", "--loss-scale", "1000"]) == 2
    err = capsys.readouterr().err
    assert "power of two" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="^loss_scale_growth must be"):  # Python names its keyword
        Pipeline(_model(), balance=[3, 2], precision="fp16", executor="emulate", loss_scale_growth=0)


class _Block(nn.Module):
    """A torchvision-style basic residual block (written here: no torchvision)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def test_user_models_train_under_fp16_without_nan():
    torch.manual_seed(0)
    resnet = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), _Block(8), _Block(8),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    images = [(torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))) for _ in range(6)]
    losses = Pipeline(resnet, balance=[4, 4], schedule="pipedream", microbatches=2, executor="emulate",
                      optimizer="sgd:lr=0.05,momentum=0.9", precision="fp16").train(images)
    assert all(math.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in resnet.parameters())

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(6, 16)
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                                 num_layers=2, enable_nested_tensor=False)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)).mean(dim=1))

    torch.manual_seed(0)
    model = Encoder()
    seqs = [(torch.randn(8, 5, 6), torch.randint(0, 3, (8,))) for _ in range(6)]
    pipe = Pipeline(model, stages=2, schedule="1f1b", microbatches=2, executor="emulate", optimizer="adam:lr=0.003",
                    precision="fp16")
    losses = pipe.train(seqs)
    assert all(math.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert pipe.last_result.extra["loss_scale"]["stages_agree"]
