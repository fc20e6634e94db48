"""pipetrain.data.loader: a user's DataLoader as per-update batches, read in order on stage 0."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from pipetrain.data import DataInfo, DataReadError, LoaderBatches
from pipetrain.data.loader import loader_info
from pipetrain.errors import ConfigError


class Flipping(Dataset):
    """Augments in __getitem__ with torch's and Python's global generators."""

    def __init__(self, n: int = 20) -> None:
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i].flip(0) if torch.rand(()) < 0.5 else self.x[i]
        return x + random.random(), i % 4


class Broken(Flipping):
    def __getitem__(self, i: int):
        if i == 7:
            raise ValueError("cannot decode sample 7")
        return super().__getitem__(i)


def _all(batches: LoaderBatches, updates) -> list:
    try:
        return [batches.batch(t) for t in updates]
    finally:
        batches.close()


def _equal(a, b) -> bool:
    return all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True))


def test_batches_follow_the_loader_across_epochs():
    data = TensorDataset(torch.arange(12.0)[:, None], torch.arange(12))
    batches = LoaderBatches(DataLoader(data, batch_size=4, shuffle=False))
    assert batches.updates_per_epoch == 3 and batches.steps_for_epochs(2.5) == 8
    got = _all(batches, range(7))
    assert [y.tolist() for _, y in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2 + [[0, 1, 2, 3]]
    assert batches.epoch == 2


def test_a_short_last_batch_is_skipped_with_one_warning():
    data = TensorDataset(torch.zeros(10, 1), torch.arange(10))
    batches = LoaderBatches(DataLoader(data, batch_size=4))
    assert batches.updates_per_epoch == 2  # full batches only
    with pytest.warns(UserWarning, match="skipping a batch of 2 samples.*drop_last=True"):
        got = _all(batches, range(4))
    assert [y.tolist() for _, y in got] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2 and batches.skipped == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_augmented_loader_is_the_same_whatever_the_global_generators(workers):
    def run(global_seed: int):
        torch.manual_seed(global_seed), random.seed(global_seed)
        loader = DataLoader(Flipping(), batch_size=5, shuffle=True, num_workers=workers)
        return _all(LoaderBatches(loader, seed=11), range(9))

    first = run(0)
    assert _equal(first, run(1))  # the run's seed decides, not what the process drew before
    assert not _equal(first[:4], _all(LoaderBatches(DataLoader(Flipping(), batch_size=5, shuffle=True,
                                                                 num_workers=workers), seed=12), range(4)))
    # epochs differ in order, and every epoch visits every sample once
    ids = [sorted(y.tolist()) for _, y in first]
    assert [y.tolist() for _, y in first[:4]] != [y.tolist() for _, y in first[4:8]]
    assert sorted(sum(ids[:4], [])) == sorted(i % 4 for i in range(20))


def test_reading_leaves_the_training_threads_generators_alone():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    _all(LoaderBatches(DataLoader(Flipping(), batch_size=5, shuffle=True), seed=0), range(6))
    assert torch.equal(torch.rand(2), expected)


def test_set_epoch_is_called_for_each_epoch():
    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __len__(self):
            return 4

        def __iter__(self):
            return iter(range(4))

    sampler = Sampler()
    _all(LoaderBatches(DataLoader(Flipping(), batch_size=2, sampler=sampler)), range(5))
    assert sampler.epochs == [0, 1, 2]


def test_late_requests_are_kept_and_earlier_ones_refused():
    batches = LoaderBatches(DataLoader(TensorDataset(torch.zeros(40, 1), torch.arange(40)), batch_size=2), keep=3)
    try:
        assert batches.batch(1)[1].tolist() == [2, 3]
        assert batches.batch(0)[1].tolist() == [0, 1]  # kept: a little late is fine
        assert batches.batch(10)[1].tolist() == [20, 21]  # ahead: the batches between are read and dropped
        assert batches.batch(8)[1].tolist() == [16, 17]
        with pytest.raises(ConfigError, match="read in order"):
            batches.batch(2)
    finally:
        batches.close()


def test_batch_sizes_must_agree():
    data = TensorDataset(torch.zeros(8, 1), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ConfigError, match="batch_size is 4 but the run's batch size is 8: give batch_size=4"):
        LoaderBatches(DataLoader(data, batch_size=4), batch_size=8)

    class Growing(torch.utils.data.Sampler):
        def __len__(self):
            return 2

        def __iter__(self):
            return iter([[0, 1], [2, 3, 4]])

    batches = LoaderBatches(DataLoader(data, batch_sampler=Growing()))
    with pytest.raises(ConfigError, match="batch of 3 samples after batches of 2"):
        _all(batches, range(2))


@pytest.mark.filterwarnings("ignore:skipping a batch")
def test_what_a_batch_must_be():
    def collate(samples):
        return {"x": torch.stack([s[0] for s in samples])}

    with pytest.raises(ConfigError, match="pair \\(inputs, targets\\), got a dict"):
        _all(LoaderBatches(DataLoader(Flipping(), batch_size=2, collate_fn=collate)), range(1))
    with pytest.raises(ConfigError, match="not iter\\(loader\\)"):
        LoaderBatches(iter(DataLoader(Flipping(), batch_size=2)))
    with pytest.raises(ConfigError, match="no full batch"):
        LoaderBatches(DataLoader(Flipping(3), batch_size=4, drop_last=True)).steps_for_epochs(1)
    with pytest.raises(ConfigError, match="no batch of 4 samples in epoch 0"):
        _all(LoaderBatches(DataLoader(Flipping(3), batch_size=4)), range(1))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_getitem_is_one_message(workers):
    batches = LoaderBatches(DataLoader(Broken(), batch_size=4, num_workers=workers))
    with pytest.raises(DataReadError) as caught:
        _all(batches, range(3))
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("reading the batch of update 1 from the DataLoader failed: ValueError: ")
    assert "cannot decode sample 7" in str(caught.value)


def test_loader_info_and_iterable_data_sets():
    assert loader_info(DataLoader(Flipping(), batch_size=2)) == DataInfo((3,), 4)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(5), 1)] * 6)

    with pytest.raises(ConfigError, match="of class labels: give it a num_classes attribute"):
        loader_info(DataLoader(Stream(), batch_size=2))
    stream = Stream()
    stream.num_classes = 3
    assert loader_info(DataLoader(stream, batch_size=2)) == DataInfo((5,), 3)
    batches = LoaderBatches(DataLoader(stream, batch_size=2))
    assert batches.updates_per_epoch is None
    with pytest.raises(ConfigError, match="no length"):
        batches.steps_for_epochs(1)
    assert [y.tolist() for _, y in _all(batches, range(4))] == [[1, 1]] * 4


def test_a_loader_whose_worker_dies_is_a_fault_not_bad_data(monkeypatch):
    import dying_data

    from pipetrain.data import LoaderBatches
    from pipetrain.runtime.errors import DataWorkerLost

    monkeypatch.setenv("PIPETRAIN_RESTART", "0")  # the first start: the data worker kills itself (SIGKILL)
    loader = torch.utils.data.DataLoader(dying_data.make(die_after=30), batch_size=12, num_workers=1)
    batches = LoaderBatches(loader, seed=0)
    try:
        with pytest.raises(DataWorkerLost, match=r"the DataLoader worker process \(pid \d+\) reading its batches "
                                                 "was killed by SIGKILL") as caught:
            for update in range(40):
                batches.batch(update)
        assert caught.value.exit_status == 128 + 9  # restartable, as a killed worker is
    finally:
        batches.close()


def test_the_data_line_counts_a_loader_in_batches(capsys):
    """A loader of 10 batches of 8 (its items whole batches: batch_size=None) is "10 batches", not "10 samples"."""
    from pipetrain import Pipeline

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(10)]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    Pipeline(model, stages=2, schedule="1f1b", executor="emulate").fit(DataLoader(batches, batch_size=None),
                                                                      batch_size=8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1f1b: 2 stages on 2 emulated ranks, 10 updates of 8 samples"), lines
    assert lines[1] == "data: 10 batches, read from the DataLoader, on the training thread", lines
