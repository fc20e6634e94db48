"""pipetrain.data.batches: every kind of data set read ahead, each update's batch the same bytes
however it is read (worker processes, the training thread, out of order)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipetrain.data import BatchSampler, DataReadError, DatasetBatches
from pipetrain.data.batches import describe_reading, resolve_workers
from pipetrain.errors import ConfigError


class Augmented(Dataset):
    """A user's data set with torchvision-style augmentation drawing from all three generators."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 2, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if torch.rand(()) < 0.5:  # random flip
            x = x.flip(-1)
        start = int(np.random.randint(0, 3))  # random crop
        x = x[:, start : start + 4]
        return x * (1 + 0.1 * random.random()), int(self.y[i])


class Failing(Augmented):
    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def __getitem__(self, i: int):
        if i == self.bad:
            raise KeyError(f"sample {i} is missing")
        return super().__getitem__(i)


def _batches(dataset, workers, order=range(8), seed=3, **options) -> DatasetBatches:
    sampler = BatchSampler(dataset, 6, seed=seed)
    return DatasetBatches(dataset, sampler.indices, seed=seed, order=order, workers=workers, **options)


def _read(batches: DatasetBatches, updates) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        return [batches.batch(t) for t in updates]
    finally:
        batches.close()


def test_augmented_batches_do_not_depend_on_who_reads_them():
    reference = _read(_batches(Augmented(), workers=0), range(8))
    for workers in (1, 2):
        batches = _batches(Augmented(), workers=workers)
        assert batches.read_ahead and batches.reading == f"sample by sample in {workers} DataLoader worker process" + "es" * (workers > 1)
        got = _read(batches, range(8))
        for (x, y), (rx, ry) in zip(got, reference):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    again = _read(_batches(Augmented(), workers=0, order=None), range(8))  # nothing read ahead
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, reference))
    other_seed = _read(_batches(Augmented(), workers=0, seed=4), range(1))
    assert not torch.equal(other_seed[0][0], reference[0][0])


def test_out_of_order_requests_get_the_same_batches():
    reference = _read(_batches(Augmented(), workers=0), range(40))
    batches = _batches(Augmented(), workers=1, order=range(40))
    # late by one (stage 0's replicas take turns), then passed (read here), far ahead (restart), outside the order
    asked = [1, 0, 3, 2, 4, 0, 30, 31, 5, 45]
    got = _read(batches, asked)
    extra = _read(_batches(Augmented(), workers=0, order=None), [45])[0]
    for update, (x, y) in zip(asked, got):
        rx, ry = reference[update] if update < 40 else extra
        assert torch.equal(x, rx) and torch.equal(y, ry), update


def test_reading_leaves_the_training_threads_generators_alone():
    for workers in (0, 1):
        torch.manual_seed(9)
        expected = torch.rand(3)
        torch.manual_seed(9)
        _read(_batches(Augmented(), workers=workers), range(4))
        assert torch.equal(torch.rand(3), expected)


def test_data_sets_read_by_index_stay_on_the_fast_path():
    tensors = TensorDataset(torch.arange(40.0)[:, None], torch.arange(40) % 3)
    for data in (tensors, Subset(tensors, list(range(39, -1, -1)))):
        batches = _batches(data, workers=2)
        assert batches.workers == 0 and batches.reading == "by index, ahead on a background thread"
        sampler = BatchSampler(data, 6, seed=3)
        for t, (x, y) in enumerate(_read(batches, range(8))):
            index = sampler.indices(t)
            expected = torch.stack([data[int(i)][0] for i in index])
            assert torch.equal(x, expected) and y.dtype == torch.int64


def test_dtype_is_applied_in_every_reader():
    for workers in (0, 1):
        x, _ = _read(_batches(Augmented(), workers=workers, dtype=torch.float64), [0])[0]
        assert x.dtype == torch.float64


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_getitem_is_one_message_naming_the_update(workers):
    sample = int(BatchSampler(48, 6, seed=0).indices(3)[2])
    batches = _batches(Failing(sample), workers=workers, seed=0)
    with pytest.raises(DataReadError) as caught:
        _read(batches, range(5))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"reading the batch of update 3 failed: data set Failing: reading sample {sample} raised "
                              f"KeyError: 'sample {sample} is missing' (test_data_batches.py:")


def test_worker_counts():
    assert resolve_workers(None) == 1 and resolve_workers(0) == 0 and resolve_workers(3) == 3
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="data_workers must be an integer >= 0"):
            resolve_workers(bad)
    assert describe_reading(Augmented(), 0) == "on the training thread (data_workers=0)"
    from pipetrain.errors import naming_options_as

    with naming_options_as("flag"):  # the command line's data line names the flag
        assert describe_reading(Augmented(), 0) == "on the training thread (--data-workers 0)"
    assert describe_reading(TensorDataset(torch.zeros(2, 1), torch.zeros(2)), 4).startswith("by index")


def test_pin_memory_without_an_accelerator_warns_and_reads_anyway():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: batches are pinned")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, _ = _read(_batches(Augmented(), workers=0, pin_memory=True), [0])[0]
    assert any("pin_memory" in str(w.message) for w in caught) and x.shape == (6, 2, 4)
