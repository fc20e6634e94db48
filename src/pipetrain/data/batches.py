"""Each update's batch of a map-style data set, read ahead the fastest way its kind allows.

==========================================  ============================================================
data set                                    how update t's batch is read
==========================================  ============================================================
two tensors, or a ``batch(indices)`` method  one indexing operation, on a background thread ahead, in
(built-ins, ``TensorDataset``, ``text``)      groups of :func:`group_size` updates; no generator is
                                            seeded (the batch is a function of its indices),
                                            whatever ``workers`` says
any other map-style ``Dataset``               in ``workers`` DataLoader worker processes (default
                                            :data:`DEFAULT_WORKERS`), read ahead in groups of
                                            :func:`group_size` updates, under ``data_seed(seed, t)``
any other, ``workers=0``                      on the training thread when needed, under
                                            ``data_seed(seed, t)``, its generators restored after
==========================================  ============================================================

``Subset`` wrappers count as the data set below them, and cost O(batch) per read. Because every
plain batch is read under its own seed (:mod:`pipetrain.data.seeding`), the batches, and so the
trained parameters, do not depend on ``workers``, on the executor, or on which process reads.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from pipetrain.data.info import reads_by_index
from pipetrain.data.prefetch import BatchPrefetcher, PACK_LIMIT, WorkerPrefetcher, pin, pin_available
from pipetrain.data.updates import UpdateBatches, raise_failed
from pipetrain.errors import ConfigError, option, written
from pipetrain.structure import tensors_of

__all__ = ["DatasetBatches", "DEFAULT_WORKERS", "resolve_workers", "describe_reading", "group_size"]

#: DataLoader worker processes for a data set read sample by sample when none is asked for. One:
#: on the project's 2-core machine it kept pace with two (both cores run pipeline ranks) and beat
#: reading on the training thread (benchmarks/RESULTS.md, "Data path").
DEFAULT_WORKERS = 1


def resolve_workers(workers: int | None) -> int:
    """``workers``, or :data:`DEFAULT_WORKERS` for None; refuses anything but an integer >= 0."""
    if workers is None:
        return DEFAULT_WORKERS
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigError(f"{option('data_workers')} must be an integer >= 0 (0 reads on the training thread), "
                          f"got {workers!r}")
    return workers


#: most updates a worker reads and sends in one message, and the longest its reads should take
MAX_GROUP, GROUP_SECONDS = 16, 0.005


def group_size(batch: Any, seconds: float) -> int:
    """How many updates one worker (or the background thread) reads and sends together, from one
    batch and its read time:
    as many as fit in :data:`~pipetrain.data.prefetch.PACK_LIMIT` bytes and
    :data:`GROUP_SECONDS` of reading, at most :data:`MAX_GROUP`, at least 1. Small, quick batches
    share one message between processes (about 0.3-1 ms each on the project's machine, more than
    reading 32 small samples); large or slow ones gain nothing from it. It changes no result."""
    size = sum(t.numel() * t.element_size() for t in tensors_of(batch))
    return max(1, min(MAX_GROUP, PACK_LIMIT // max(size, 1), int(GROUP_SECONDS / max(seconds, 1e-9))))


def describe_reading(dataset: Dataset, workers: int | None) -> str:
    """How :class:`DatasetBatches` (or, for a DataLoader, :class:`~pipetrain.data.LoaderBatches`)
    will read ``dataset``'s batches ahead, in words."""
    if isinstance(dataset, DataLoader):
        count = int(dataset.num_workers or 0)
        return "from the DataLoader, " + (
            f"in its {count} worker process{'es' * (count > 1)}" if count else "on the training thread"
        )
    if reads_by_index(dataset):
        return "by index, ahead on a background thread"
    workers = resolve_workers(workers)
    if workers:
        return f"sample by sample in {workers} DataLoader worker process{'es' * (workers > 1)}"
    return written(f"on the training thread ({option('data_workers', 0)})")


class DatasetBatches:
    """``batch(update)``: the samples ``indices_of_update(update)`` of ``dataset`` as ``(x, y)``.

    ``order``: the updates the caller reads, in the order it reads them (each once); without it
    nothing is read ahead. See the module docstring for where each kind of data set is read, and
    :meth:`close` at the end (it stops the worker processes).
    """

    def __init__(
        self,
        dataset: Dataset,
        indices_of_update: Callable[[int], torch.Tensor],
        *,
        seed: int = 0,
        order: Sequence[int] | None = None,
        workers: int | None = None,
        pin_memory: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.reads = UpdateBatches(dataset, indices_of_update, seed=seed, dtype=dtype)
        self.workers = resolve_workers(workers)
        self._thread: BatchPrefetcher | None = None
        self._processes: WorkerPrefetcher | None = None
        self._first: tuple[int, Any] | None = None
        self.group = 1  # updates a worker reads and sends together
        pinning = pin_available(pin_memory)
        if order is not None and not isinstance(order, range):  # a long run's range stays one: no table
            order = list(order)
        if reads_by_index(dataset):
            self.workers = 0
            self._read_here: Callable[[int], Any] = self.reads.read_unseeded
            self.reading = "by index"
        elif self.workers and order is not None and len(order):
            self._read_here = self.reads.read
            started = time.perf_counter()
            self._first = (order[0], self.reads.read(order[0]))  # the first batch, read here, sizes the groups
            self.group = group_size(self._first[1], time.perf_counter() - started)
            self._processes = WorkerPrefetcher(self.reads, order[1:], workers=self.workers, pin_memory=pinning,
                                               group=self.group)
            self.reading = f"sample by sample in {self.workers} DataLoader worker process{'es' * (self.workers > 1)}"
        else:
            self.workers = 0
            self._read_here = self.reads.read
            self.reading = "sample by sample on the training thread"
        if pinning:
            read = self._read_here
            self._read_here = lambda update: pin(read(update))
        if self.reading == "by index" and order is not None and len(order):
            self._first = (order[0], self._read_here(order[0]))  # read here: it sizes the groups
            started = time.perf_counter()
            self._read_here(order[0])  # timed again, without the first call's warm-up
            self.group = group_size(self._first[1], time.perf_counter() - started)
            self._thread = BatchPrefetcher(self._read_here, order[1:], group=self.group)
            self.reading += ", ahead on a background thread"

    @property
    def read_ahead(self) -> bool:
        """Whether batches are read before they are asked for (a thread or worker processes)."""
        return self._thread is not None or self._processes is not None

    def batch(self, update: int) -> tuple[Any, torch.Tensor]:
        """Update ``update``'s batch (any update; those in ``order`` come read ahead)."""
        if self._first is not None and self._first[0] == update:
            batch, self._first = self._first[1], None
            return batch
        if self._thread is not None:
            return self._thread.get(update)
        if self._processes is not None:
            batch = self._processes.get(update)
            if batch is not None:
                return raise_failed(batch)
        return self._read_here(update)

    def close(self) -> None:
        """Stop reading ahead: the thread, or the worker processes (a no-op otherwise)."""
        if self._thread is not None:
            self._thread.close()
        if self._processes is not None:
            self._processes.close()
