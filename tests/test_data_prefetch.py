"""Reading batches ahead: the same batches as reading them when needed, read one update ahead on
one background thread (only for data sets whose batches are a function of their indices) or in
worker processes, errors raised where the batch is used."""

import os
import pickle
import threading
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipetrain.data.info import reads_by_index
from pipetrain.execution import UnitData, UnitLayout
from pipetrain.data.prefetch import (
    PACK_LIMIT,
    BatchPrefetcher,
    Receiver,
    WorkerPrefetcher,
    _Packed,
    tensors_of,
    pack,
    unpack,
)


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


@pytest.mark.parametrize("order", [[0, 1, 2, 3], range(4)])  # a long run's order is a range: no table of it
def test_reads_one_update_ahead_on_one_background_thread(order) -> None:
    reads: list[tuple[int, str]] = []
    release = threading.Event()

    def load(update: int) -> int:
        if update == 2:
            release.wait(10)  # the read of 2 is under way while 1 is used
        reads.append((update, threading.current_thread().name))
        return update * 10

    prefetcher = BatchPrefetcher(load, order)
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


Pair = namedtuple("Pair", "a b")


def test_packed_batches_come_back_bit_for_bit() -> None:
    batch = (
        (torch.randn(3, 4), torch.tensor(7), Pair(torch.arange(5, dtype=torch.int16), torch.ones(2, dtype=torch.bfloat16))),
        {"mask": torch.tensor([True, False]), "empty": torch.zeros(0, 3)},
        torch.arange(6, dtype=torch.int64)[::2],  # not contiguous
        "label",
    )
    packed = pack(batch)
    assert isinstance(packed[2], _Packed) and isinstance(packed[0][2], Pair)
    back = unpack(pickle.loads(pickle.dumps(packed)))
    flat_a, flat_b = list(tensors_of(batch)), list(tensors_of(back))
    assert len(flat_a) == len(flat_b) == 7 and back[3] == "label" and isinstance(back[0][2], Pair)
    for a, b in zip(flat_a, flat_b):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    big = torch.zeros(PACK_LIMIT // 4 + 1)
    assert pack((big, big[:1]))[0] is big  # larger batches are left to DataLoader's shared memory


def test_receiver_hands_items_over_in_order_and_raises_failures() -> None:
    receiver = Receiver(iter(range(5)), lambda item: item * 10)
    assert [receiver.take() for _ in range(6)] == [(True, i * 10) for i in range(5)] + [(False, None)]
    receiver.close()

    def failing():
        yield 1
        raise KeyError("gone")

    receiver = Receiver(failing())
    assert receiver.take() == (True, 1)
    with pytest.raises(KeyError, match="gone"):
        receiver.take()
    receiver.close()
    endless = Receiver(iter(int, 1))  # never ends: close() must still stop the thread
    endless.take()
    endless.close(timeout=5)
    assert not endless._thread.is_alive()


class _Squares(Dataset):
    """Item t is update t's "batch": read in a worker process."""

    def __getitem__(self, t: int):
        return torch.full((2,), float(t * t)), torch.tensor([os.getpid()])


def test_worker_prefetcher_reads_in_other_processes_in_order() -> None:
    prefetcher = WorkerPrefetcher(_Squares(), range(10), workers=2, keep=2)
    try:
        got = {t: prefetcher.get(t) for t in (0, 1, 3, 2, 9)}
        assert {t: float(x[0]) for t, (x, _) in got.items()} == {t: float(t * t) for t in got}
        assert all(int(pid) != os.getpid() for _, pid in got.values())
        assert prefetcher.get(4) is None  # passed and not kept (keep=2 held 2, then 4..8 went by): read it yourself
        assert prefetcher.get(42) is None  # outside the order
    finally:
        prefetcher.close()


def test_worker_prefetcher_groups_updates_and_restarts_far_ahead() -> None:
    prefetcher = WorkerPrefetcher(_Squares(), range(200), workers=1, group=4, keep=2)
    try:
        assert float(prefetcher.get(0)[0][0]) == 0.0
        pids = {int(prefetcher.get(t)[1]) for t in (1, 2, 3)}  # one group, one worker
        assert float(prefetcher.get(150)[0][0]) == 150.0**2  # far ahead: the stream starts again there
        assert float(prefetcher.get(151)[0][0]) == 151.0**2
        assert prefetcher.get(4) is None
        assert len(pids) == 1 and os.getpid() not in pids
    finally:
        prefetcher.close()


def test_group_size_follows_batch_bytes_and_read_time() -> None:
    from pipetrain.data.batches import MAX_GROUP, group_size

    small = (torch.zeros(32, 64), torch.zeros(32, dtype=torch.int64))
    assert group_size(small, 1e-4) == MAX_GROUP
    assert group_size(small, 0.002) == 2  # slow reads: less in one message
    assert group_size((torch.zeros(PACK_LIMIT // 4),), 1e-4) == 1  # large batches travel alone


class _Affinity(Dataset):
    def __getitem__(self, t: int):
        return torch.tensor(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_data_workers_of_a_pinned_rank_may_use_every_core(monkeypatch) -> None:
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("PIPETRAIN_CPUS", str(cores[0]))  # as pipetrain's launcher pins a rank
    os.sched_setaffinity(0, cores[:1])
    try:
        prefetcher = WorkerPrefetcher(_Affinity(), range(2), workers=1)
        try:
            assert prefetcher.get(0).tolist() == cores
        finally:
            prefetcher.close()
        monkeypatch.delenv("PIPETRAIN_CPUS")  # pinned by someone else: left as it is
        prefetcher = WorkerPrefetcher(_Affinity(), range(2), workers=1)
        try:
            assert prefetcher.get(0).tolist() == cores[:1]
        finally:
            prefetcher.close()
    finally:
        os.sched_setaffinity(0, cores)


def test_groups_of_updates_are_read_in_one_task_and_a_failure_raises_at_its_own_update() -> None:
    tasks: list[list[int]] = []
    current: list[int] = []

    def load(update: int) -> int:
        if update == 7:
            raise ValueError("update 7 is unreadable")
        current.append(update)
        return update * 10

    order = [0, 2, 4, 5, 6, 7, 8, 9]  # not consecutive: every update this rank reads, in its order
    prefetcher = BatchPrefetcher(load, order, group=3)
    original = prefetcher._read_group

    def read_group(index: int):
        current.clear()
        result = original(index)
        tasks.append(list(current))
        return result

    prefetcher._read_group = read_group
    try:
        assert [prefetcher.get(u) for u in (0, 2, 4, 5, 6)] == [0, 20, 40, 50, 60]
        with pytest.raises(ValueError, match="update 7 is unreadable"):
            prefetcher.get(7)
        assert prefetcher.get(8) == 80 and prefetcher.get(9) == 90  # read when asked, after the failure
        assert prefetcher.get(1) == 10  # outside the order: read when asked for
        assert tasks[:2] == [[0, 2, 4], [5, 6]]  # a group per task; the third stopped at 7
    finally:
        prefetcher.close()


_SOCKETS_SCRIPT = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from pipetrain.data.loader import LoaderBatches
from pipetrain.data.prefetch import WorkerPrefetcher

def sockets():
    # the socket inodes this process holds (from /proc/self/fd)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.append(int(target[8:-1]))
    return found

def tcp():
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            inodes |= {int(line.split()[9]) for line in f.readlines()[1:]}
    return inodes

class Held(Dataset):
    # each item: the sockets of the DataLoader worker process that reads it
    def __len__(self):
        return 4
    def __getitem__(self, i):
        import ctypes, signal
        death = ctypes.c_int(0)
        ctypes.CDLL(None).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG: the signal it gets when its rank dies
        return torch.tensor(sockets()), torch.tensor([death.value])

store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # a rank: its store connection is TCP
rank = sorted(set(sockets()) & tcp())
prefetched, prefetched_death = WorkerPrefetcher(Held(), [0, 1], workers=1).get(0)
loader = LoaderBatches(DataLoader(Held(), batch_size=None, num_workers=1), seed=0)
own, own_death = loader.batch(0)
print(json.dumps({"rank": rank, "prefetcher": prefetched.tolist(), "loader": own.tolist(),
                  "deaths": [prefetched_death.item(), own_death.item()]}))
sys.stdout.flush()
os._exit(0)
"""


def test_data_workers_do_not_hold_the_sockets_of_their_rank_nor_outlive_it() -> None:
    import json
    import signal
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _SOCKETS_SCRIPT], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["rank"], "the rank holds TCP sockets (its store connections, gloo's)"
    # a worker holding them kept the rank's connections open after the rank died: its peers waited
    assert not set(seen["rank"]) & set(seen["prefetcher"]), seen  # pipetrain's own data workers
    assert not set(seen["rank"]) & set(seen["loader"]), seen  # the workers of a user's DataLoader
    # and both die with their rank (SIGKILL), not up to 5 s later, holding its stderr meanwhile
    assert seen["deaths"] == [signal.SIGKILL, signal.SIGKILL], seen
