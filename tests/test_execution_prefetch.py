"""Reading batches ahead: the same batches as reading them when needed, read one update ahead on
one background thread, errors raised where the batch is used, and only for data sets whose
batches are a function of their indices."""

import threading

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipetrain.data.info import reads_by_index
from pipetrain.execution import UnitData, UnitLayout
from pipetrain.execution.prefetch import BatchPrefetcher


def _data(prefetch=None, dataset=None):
    g = torch.Generator().manual_seed(0)
    dataset = dataset or TensorDataset(torch.randn(40, 3, generator=g), torch.randint(0, 5, (40,), generator=g))
    indices = lambda update: torch.arange(update * 8, update * 8 + 8) % 40  # noqa: E731
    return UnitData(dataset, UnitLayout(8, 4), indices, prefetch=prefetch)


def test_prefetched_units_equal_units_read_when_needed() -> None:
    plain, ahead = _data(), _data(prefetch=range(6))
    try:
        assert ahead.prefetching and not plain.prefetching
        for unit in range(24):
            (x0, y0), (x1, y1) = plain.unit(unit), ahead.unit(unit)
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    finally:
        ahead.close()


def test_reads_one_update_ahead_on_one_background_thread() -> None:
    reads: list[tuple[int, str]] = []
    release = threading.Event()

    def load(update: int) -> int:
        if update == 2:
            release.wait(10)  # the read of 2 is under way while 1 is used
        reads.append((update, threading.current_thread().name))
        return update * 10

    prefetcher = BatchPrefetcher(load, [0, 1, 2, 3])
    try:
        assert prefetcher.get(0) == 0
        assert prefetcher.get(1) == 10  # read ahead when 0 was asked for
        assert [u for u, _ in reads] == [0, 1]  # and 2 started, held back by the event
        release.set()
        assert prefetcher.get(2) == 20
        assert prefetcher.get(3) == 30
        assert prefetcher.get(7) == 70  # outside the order: read when asked for
    finally:
        prefetcher.close()
    assert [u for u, _ in reads] == [0, 1, 2, 3, 7]
    main = threading.current_thread().name
    assert len({name for _, name in reads}) == 1 and reads[0][1] != main


def test_a_failed_read_raises_where_the_batch_is_used() -> None:
    def load(update: int) -> int:
        if update == 1:
            raise ValueError("sample 9 is corrupt")
        return update

    prefetcher = BatchPrefetcher(load, [0, 1])
    try:
        assert prefetcher.get(0) == 0  # the failing read of 1 started here but does not raise yet
        with pytest.raises(ValueError, match="sample 9 is corrupt"):
            prefetcher.get(1)
    finally:
        prefetcher.close()


def test_closed_prefetcher_refuses_reads() -> None:
    prefetcher = BatchPrefetcher(lambda update: update, [0, 1])
    prefetcher.close()
    prefetcher.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        prefetcher.get(0)


class _Augmented(Dataset):
    """Reads sample by sample and draws random numbers: must not be read on another thread."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.randn(3), torch.tensor(i % 5)


def test_only_data_sets_read_by_index_are_read_ahead() -> None:
    tensors = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    assert reads_by_index(tensors) and reads_by_index(Subset(tensors, [0, 1]))
    assert not reads_by_index(_Augmented()) and not reads_by_index(None)
    data = _data(prefetch=range(3), dataset=_Augmented())
    assert not data.prefetching
    data.unit(0)
    data.close()


def test_runtime_reads_ahead_in_the_order_of_its_stage_0_forwards() -> None:
    from pipetrain.training.distributed import _updates_read
    from pipetrain.schedule import build

    # 1F1B, 2 steps of 4 microbatches: rank 0 reads update 0 then 1; rank 1 reads nothing
    schedule = build("1f1b", 2, 4, steps=2)
    layout = UnitLayout(8, 4)
    assert _updates_read(schedule, 0, layout) == [0, 1]
    assert _updates_read(schedule, 1, layout) == []
    # PipeDream with stage 0 on two replicas: each unit is an update, and each replica reads its own
    schedule = build("pipedream", 2, 8, replicas=[2, 1])
    layout = UnitLayout(4, 1)
    first, second = (_updates_read(schedule, rank, layout) for rank in schedule.stage_ranks[0])
    assert sorted(first + second) == list(range(8)) and not set(first) & set(second)
    assert first == sorted(first) and second == sorted(second)
