"""Targets reach the loss as the data set gives them: float regression targets stay float with
their values, a tuple or dict of targets arrives whole, on every schedule family and executor.

The bug this pins: a ``TensorDataset(X, Y)`` with float ``Y`` used to hand the loss ``int64``
zeros (the labels were cast for a classifier), so that ``Y + 0.5`` trained exactly as ``Y``. Now
a synchronous schedule trains a regression bitwise as a plain one-thread loop with the same
microbatch accumulation, every schedule's loss sees each unit's own rows of ``Y``, and the
runtime equals the emulator. Only a loss that needs class indices (the default cross entropy)
refuses float targets, in one line, before any training.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from pipetrain import Pipeline
from pipetrain.data import BatchSampler, get_batch
from pipetrain.errors import ConfigError
from pipetrain.training import TrainConfig

FEATURES = 6


def regression_data(samples: int = 64, split: str = "train") -> TensorDataset:
    """A noisy linear target of ``FEATURES`` inputs: float32 ``Y`` of shape ``(N,)``."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randn(samples, FEATURES, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, FEATURES) * 0.4 + 0.1 * torch.randn(samples, generator=g)
    return TensorDataset(x, y)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def regressor(in_features: int = FEATURES) -> nn.Sequential:
    """A small MLP with one output per sample (``nn.Flatten(0)`` drops the unit dimension); its
    ``pipeline_loss`` is the mean squared error, so the command line trains it as such."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1),
                          nn.Flatten(0))
    model.pipeline_loss = mse
    return model


class Recorded:
    """A loss that remembers the dtype and values of every target it is given."""

    def __init__(self, loss) -> None:
        self.loss, self.seen = loss, []

    def __call__(self, output, target):
        if not getattr(output, "is_meta", False):  # not the set-up check of shapes on the meta device
            self.seen.append(target)
        return self.loss(output, target)


def plain_training(model, dataset, steps, batch_size, microbatches, loss, lr=0.05):
    """One thread, plain PyTorch: each microbatch's mean loss times its share, accumulated, one step."""
    sampler = BatchSampler(dataset, batch_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    losses = []
    for t in range(steps):
        x, y = get_batch(dataset, sampler.indices(t))
        opt.zero_grad()
        total = 0.0
        for rows in torch.arange(batch_size).tensor_split(microbatches):
            ys = {k: v[rows] for k, v in y.items()} if isinstance(y, dict) else \
                tuple(v[rows] for v in y) if isinstance(y, tuple) else y[rows]
            part = loss(model(x[rows]), ys) * (len(rows) / batch_size)
            part.backward()
            total += float(part.detach())
        opt.step()
        losses.append(total)
    return losses


SYNCHRONOUS = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


@pytest.mark.parametrize("schedule, chunks", SYNCHRONOUS)
def test_float_targets_train_as_plain_pytorch_on_every_synchronous_schedule(schedule, chunks):
    data = regression_data()
    model, reference = regressor(), regressor()
    recorded = Recorded(mse)
    pipe = Pipeline(model, stages=2, chunks=chunks, schedule=schedule, microbatches=4, loss_fn=recorded,
                    optimizer="sgd:lr=0.05,momentum=0.9", executor="emulate")
    pipe.fit(data, batch_size=16, steps=3, quiet=True)
    plain_training(reference, data, 3, 16, 4, mse)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), (schedule, name)
    assert recorded.seen and all(t.dtype == torch.float32 for t in recorded.seen)
    assert all(bool(torch.isin(t, data.tensors[1]).all()) for t in recorded.seen)  # rows of Y, not zeros


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "pb"])
def test_asynchronous_schedules_see_each_units_own_float_targets(schedule):
    """No plain loop to equal (the weights are stale by design): the loss gets the targets of each
    unit as the data set holds them, and shifting the targets changes the training."""
    data = regression_data()
    shifted = TensorDataset(data.tensors[0], data.tensors[1] + 0.5)
    losses = []
    for dataset in (data, shifted):
        recorded = Recorded(mse)
        pipe = Pipeline(regressor(), stages=2, schedule=schedule, microbatches=2 if schedule == "2bw" else 1,
                        loss_fn=recorded, optimizer="sgd:lr=0.02", executor="emulate")
        result = pipe.fit(dataset, batch_size=8, steps=4, shuffle=False, quiet=True)
        units = torch.cat([t.reshape(-1) for t in recorded.seen])
        assert units.dtype == torch.float32
        assert torch.equal(units, dataset.tensors[1][: len(units)])  # in order, unshuffled, as given
        losses.append(result.update_losses)
    assert losses[0] != losses[1]


class Paired(Dataset):
    """Inputs with two targets: a float value and an integer class, as a dict or a tuple."""

    def __init__(self, form: str, samples: int = 32) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(samples, FEATURES, generator=g)
        self.value = torch.randn(samples, generator=g, dtype=torch.float64)
        self.label = torch.randint(0, 3, (samples,), generator=g, dtype=torch.int32)
        self.form = form

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.form == "dict":
            return self.x[i], {"value": self.value[i], "label": self.label[i]}
        return self.x[i], (self.value[i], self.label[i])


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(FEATURES, 12), nn.Tanh())
        self.head = nn.Linear(12, 4)  # one regression output and three class scores

    def forward(self, x):
        return self.head(self.body(x))


def two_losses(output, target):
    value, label = (target["value"], target["label"]) if isinstance(target, dict) else target
    return (nn.functional.mse_loss(output[:, 0], value.float())
            + nn.functional.cross_entropy(output[:, 1:], label.long()))


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_a_structure_of_targets_reaches_the_loss_intact(form):
    data = Paired(form)
    recorded = Recorded(two_losses)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, split_at=["head"], schedule="1f1b", microbatches=2, loss_fn=recorded,
                    optimizer="sgd:lr=0.05,momentum=0.9", executor="emulate")
    pipe.fit(data, batch_size=8, steps=2, quiet=True)
    first = recorded.seen[-1]
    assert type(first) is (dict if form == "dict" else tuple)
    value, label = (first["value"], first["label"]) if form == "dict" else first
    assert value.dtype == torch.float64 and label.dtype == torch.int32 and value.shape == (4,)
    plain_training(reference, data, 2, 8, 2, two_losses)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_the_default_cross_entropy_refuses_float_targets_in_one_line_before_training():
    data = regression_data()
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 3))
    pipe = Pipeline(model, stages=2, schedule="1f1b", executor="emulate")
    with pytest.raises(ConfigError) as caught:
        pipe.fit(data, batch_size=16, steps=1, quiet=True)
    text = str(caught.value)
    assert "\n" not in text and "needs integer class labels; got float32 targets" in text and "loss_fn" in text


def test_integer_labels_of_any_width_still_train_a_classifier():
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(32, FEATURES, generator=g), torch.randint(0, 3, (32,), generator=g)
    results = []
    for y in (labels, labels.to(torch.int32)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 3))
        pipe = Pipeline(model, stages=2, schedule="1f1b", executor="emulate")
        results.append(pipe.fit(TensorDataset(x, y), eval_data=TensorDataset(x, y), batch_size=8, steps=2,
                                quiet=True))
    assert results[0].update_losses == results[1].update_losses
    assert results[0].evaluations[-1]["accuracy"] is not None


def test_a_regression_is_evaluated_without_an_accuracy(capsys):
    pipe = Pipeline(regressor(), stages=2, schedule="1f1b", microbatches=2, executor="emulate",
                    optimizer="sgd:lr=0.05")
    result = pipe.fit(regression_data(), eval_data=regression_data(32, "test"), batch_size=16, steps=2)
    final = result.evaluations[-1]
    assert final["accuracy"] is None and final["loss"] > 0
    assert "test accuracy" not in capsys.readouterr().out


def test_the_command_line_trains_a_regression_factory_and_refuses_a_builtin_classifier(capsys):
    from pipetrain.cli import main

    assert main(["train", "--model", "test_targets:regressor", "--data", "test_targets:regression_data",
                 "--stages", "2", "--schedule", "1f1b", "--steps", "3", "--batch-size", "16",
                 "--executor", "emulate", "--optimizer", "sgd:lr=0.05"]) == 0
    out = capsys.readouterr().out
    assert "test loss" in out and "test accuracy" not in out
    assert main(["train", "--model", "mlp", "--data", "test_targets:regression_data", "--stages", "2", "--steps", "1",
                 "--executor", "emulate"]) == 2
    assert "not integer class labels" in capsys.readouterr().err


def test_the_runtime_equals_the_emulator_on_float_and_structured_targets(tmp_path):
    from distributed_parity import assert_distributed_equals_emulated

    base = dict(model="test_targets:regressor", data="test_targets:regression_data", batch_size=8, steps=3,
                optimizer="sgd:lr=0.05,momentum=0.9", progress=False, timeout=60.0, stages=2,
                executor="distributed", balance_by="params", eval_every=3)
    configs = [TrainConfig(schedule="1f1b", microbatches=2, **base), TrainConfig(schedule="pipedream", **base),
               TrainConfig(**{**base, "model": "test_targets:two_heads", "data": "test_targets:paired_dict"},
                           schedule="1f1b", microbatches=2)]
    configs = [dataclasses.replace(c, save=str(tmp_path / f"{i}-distributed.pt")) for i, c in enumerate(configs)]
    assert_distributed_equals_emulated(configs, 2, timeout=240)


def two_heads() -> TwoHeads:
    model = TwoHeads()
    model.pipeline_loss = two_losses
    return model


def paired_dict(split: str = "train") -> Paired:
    return Paired("dict", 32 if split == "train" else 16)
