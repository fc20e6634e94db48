"""Augmentation in a user's data set: two identical runs are bitwise equal, and the distributed
runtime equals the emulator, with a plain ``Dataset`` read in DataLoader worker processes (or on
the training thread) and with a user's own shuffling ``DataLoader`` with workers.

The data set draws from torch's global generator in ``__getitem__`` (a random crop and flip) and
the model has dropout, whose seeds the stage executors set per microbatch on the training thread:
the two must not disturb each other wherever the batch is read.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from distributed_parity import run_all
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pipetrain.runtime.launch import launch
from pipetrain.training import TrainConfig
from pipetrain.training.train import train


class CropFlip(Dataset):
    """8x8 one-channel images, randomly cropped (from a 10x10 zero-padded copy) and flipped."""

    def __init__(self, samples: int = 96, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(samples, 1, 8, 8, generator=g)
        self.labels = torch.randint(0, 4, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image = nn.functional.pad(self.images[i], (1, 1, 1, 1))
        top, left = torch.randint(0, 3, (2,)).tolist()
        image = image[:, top : top + 8, left : left + 8]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, int(self.labels[i])


def crop_flip(samples: int = 96, split: str = "train") -> CropFlip:
    return CropFlip(samples, seed=0 if split == "train" else 1)


def crop_flip_loader(samples: int = 96, batch: int = 12, workers: int = 1, split: str = "train") -> DataLoader:
    return DataLoader(crop_flip(samples, split), batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


def small_net(in_features: int, num_classes: int) -> list[nn.Module]:
    return [
        nn.Sequential(nn.Flatten(), nn.Linear(in_features, 24), nn.ReLU(), nn.Dropout(0.25)),
        nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Dropout(0.25), nn.Linear(24, num_classes)),
    ]


BASE = dict(model="test_data_augmented:small_net", data="test_data_augmented:crop_flip", stages=2, batch_size=12,
            steps=6, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, timeout=60.0, eval_samples=0)


def _emulated(tmp_path, name: str, **options) -> dict[str, torch.Tensor]:
    config = TrainConfig(executor="emulate", save=str(tmp_path / f"{name}.pt"), **{**BASE, **options})
    train(config)
    return torch.load(config.save)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_augmented_runs_are_reproducible_whoever_reads(tmp_path):
    first = _emulated(tmp_path, "a", schedule="1f1b", microbatches=2)
    assert _equal(first, _emulated(tmp_path, "b", schedule="1f1b", microbatches=2))
    assert _equal(first, _emulated(tmp_path, "c", schedule="1f1b", microbatches=2, data_workers=0))
    assert _equal(first, _emulated(tmp_path, "d", schedule="1f1b", microbatches=2, data_workers=2))
    other = _emulated(tmp_path, "e", schedule="1f1b", microbatches=2, seed=1)
    assert not _equal(first, other)
    loader = _emulated(tmp_path, "f", schedule="pipedream", data="test_data_augmented:crop_flip_loader")
    assert _equal(loader, _emulated(tmp_path, "g", schedule="pipedream", data="test_data_augmented:crop_flip_loader"))


def test_augmented_distributed_equals_emulated(tmp_path):
    evaluated = {**BASE, "eval_samples": None, "eval_every": 3}  # the held-out split augments too
    configs = [
        TrainConfig(schedule="1f1b", microbatches=2, executor="distributed", **evaluated),
        TrainConfig(schedule="pipedream", executor="distributed", **BASE),
        TrainConfig(schedule="1f1b", microbatches=3, executor="distributed", **{**BASE, "data_workers": 0}),
        TrainConfig(schedule="pipedream", executor="distributed",
                    **{**BASE, "data": "test_data_augmented:crop_flip_loader:workers=1"}),
    ]
    configs = [dataclasses.replace(c, save=str(tmp_path / f"{i}-distributed.pt"),
                                   report_json=str(tmp_path / f"{i}-distributed.json")) for i, c in enumerate(configs)]
    result = launch(run_all, (configs,), nprocs=2, timeout=240, quiet=True)
    assert result.returncode == 0, result.message
    for config in configs:
        emulated = dataclasses.replace(config, executor="emulate", save=config.save.replace("distributed", "emulated"),
                                       report_json=config.report_json.replace("distributed", "emulated"))
        train(emulated)
        assert _equal(torch.load(config.save), torch.load(emulated.save)), config.data
        reports = [json.loads(open(path).read()) for path in (config.report_json, emulated.report_json)]
        assert reports[0]["evaluations"] == reports[1]["evaluations"]
    assert [e["step"] for e in reports_of(configs[0])] == [3, 6]


def reports_of(config) -> list[dict]:
    with open(config.report_json) as handle:
        return json.load(handle)["evaluations"]


def test_a_data_factory_may_return_a_dataloader():
    from pipetrain.data import DataInfo, load_data
    from pipetrain.data.batches import describe_reading
    from pipetrain.errors import ConfigError

    data = load_data("test_data_augmented:crop_flip_loader:workers=0")
    assert isinstance(data.train, DataLoader) and isinstance(data.test, CropFlip)  # evaluated through its data set
    assert data.info == DataInfo((1, 8, 8), 4)
    assert data.note == "held out: the test split of test_data_augmented:crop_flip_loader:workers=0 (96 samples)"
    assert describe_reading(data.train, None) == "from the DataLoader, on the training thread"
    with pytest.raises(ConfigError, match="holdout cuts a Dataset"):
        load_data("test_data_augmented:crop_flip_loader", holdout=0.2)
    with pytest.raises(ConfigError, match="give batch_size=12"):
        from pipetrain.training.setup import prepare

        prepare(TrainConfig(**{**BASE, "data": "test_data_augmented:crop_flip_loader", "batch_size": 8}))
