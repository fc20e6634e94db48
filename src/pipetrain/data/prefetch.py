"""Reading the next updates' batches while the pipeline runs: on a background thread, or in
DataLoader worker processes.

Only stage 0 reads data, and a batch is read when its update's first microbatch enters the
pipeline: every other stage then waits for that read. Two ways to read ahead, both in the order
the rank will need the batches:

* :class:`BatchPrefetcher` reads on one background thread, ahead (small batches a group of
  updates at a time, one hand-over per group), overlapping the
  rank's computation and its waits for messages (torch and gloo release the GIL there). Only for
  a data set whose batch is a function of its indices (see
  :func:`pipetrain.data.info.reads_by_index`): one that draws random numbers in ``__getitem__``
  (augmentation) would interleave its draws with the training thread's.
* :class:`WorkerPrefetcher` reads in DataLoader worker processes, ``workers x prefetch_factor``
  updates ahead, any map-style data set; each process seeds its own generators per update (see
  :mod:`pipetrain.data.seeding`), so augmentation is reproducible. A receiving thread takes the
  batches from the workers' queue, so the training thread only picks up a finished batch.
  Batches up to :data:`PACK_LIMIT` bytes travel packed as bytes through the workers' pipe
  (:func:`pack`): one shared-memory segment per tensor, DataLoader's default, costs about 1 ms a
  batch on this project's machine whatever its size, bytes cost 0.2-0.3 ms below 256 KiB.
"""

from __future__ import annotations

import queue
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from pipetrain.data.worker_deaths import (death_behind, give_worker_deaths_back, keep_worker_deaths, pending_death,
                                          signal_report)
from pipetrain.data.worker_setup import settle_worker, unpinned_workers
from pipetrain.structure import map_values, tensors_of

__all__ = ["BatchPrefetcher", "WorkerPrefetcher", "Receiver", "pack", "unpack", "pin", "pin_available", "tensors_of",
           "PACK_LIMIT"]

#: batches of at most this many bytes of tensors are packed as bytes between processes (see above)
PACK_LIMIT = 512 * 1024

class BatchPrefetcher:
    """``get(update)`` returns ``load(update)``, read on a background thread; asking for an update
    also starts reading the ones that follow it in ``order`` (the updates this rank reads, each
    once, in the order it reads them). An update outside ``order`` is read when asked for.

    ``group``: how many consecutive updates of ``order`` one task of the thread reads. Handing a
    read to the thread and taking its result back costs two thread switches and a contended GIL,
    0.1-0.6 ms on a rank pinned to one core (benchmarks/RESULTS.md, "PipeDream's per-update
    costs"), more than reading a small batch by index; with a group of them the thread reads the
    next group while the training thread takes the current one's batches. A read that fails
    raises in ``get`` of its own update, in the training thread, as without groups.
    """

    def __init__(self, load: Callable[[int], Any], order: Sequence[int], group: int = 1) -> None:
        self._load = load
        self._order, self._position = _indexed(order)
        self._size = max(1, int(group))
        self._count = -(-len(self._order) // self._size)  # groups
        self._pending: dict[int, Future] = {}  # group -> its reads, under way
        self._ready: dict[int, Any] = {}  # update -> its batch (or _ReadFailure), read and not yet taken
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="pipetrain-prefetch")

    def _read_group(self, index: int) -> dict[int, Any]:
        batches: dict[int, Any] = {}
        size = self._size
        for update in self._order[index * size:(index + 1) * size]:
            try:
                batches[update] = self._load(update)
            except Exception as error:  # noqa: BLE001 - raised by get() of this update
                batches[update] = _ReadFailure(error)
                break  # the rest of the group is read when asked for
        return batches

    def get(self, update: int) -> Any:
        """The batch of ``update`` (waiting for its read if it is still under way); a read that
        failed raises here, in the training thread."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the prefetcher is closed")
        if update not in self._ready:
            position = self._position.get(update)
            if position is None:
                return pool.submit(self._load, update).result()
            index = position // self._size
            future = self._pending.pop(index, None)
            if future is None:
                future = pool.submit(self._read_group, index)
            following = index + 1
            if following < self._count and following not in self._pending:
                self._pending[following] = pool.submit(self._read_group, following)
            self._ready.update(future.result())
        batch = self._ready.pop(update, _MISSING)
        if batch is _MISSING:  # after a failed read in its group
            return pool.submit(self._load, update).result()
        if isinstance(batch, _ReadFailure):
            raise batch.error
        return batch

    def close(self) -> None:
        """Drop the reads not yet started and stop the thread (after the read under way)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
            self._ready.clear()
            pool.shutdown(wait=True)


class _ReadFailure:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


_MISSING = object()


class _Positions:
    """``get(update)``: where ``update`` stands in a range (None outside it), without a table."""

    def __init__(self, order: range) -> None:
        self._order = order

    def get(self, update: int) -> int | None:
        order = self._order
        return (update - order.start) // order.step if update in order else None


def _indexed(order: Sequence[int]) -> tuple[Sequence[int], Any]:
    """The updates to read, in order, and each one's position: a range stays a range (a long
    run reads its updates in turn: no table of them), anything else becomes a list and a dict."""
    if isinstance(order, range):
        return order, _Positions(order)
    listed = list(order)
    return listed, {update: i for i, update in enumerate(listed)}


class _Packed:
    """A tensor as a numpy array, which pickles as one buffer of bytes (dtypes numpy lacks, such
    as bfloat16, as raw uint8 with their dtype and shape)."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            tensor = tensor.detach()
        self.dtype: torch.dtype | None = None
        self.shape = tuple(tensor.shape)
        try:
            self.data = tensor.numpy()
        except (TypeError, RuntimeError):  # no numpy dtype (bfloat16, ...), or a conjugate/negative view
            self.data = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
            self.dtype = tensor.dtype

    def tensor(self) -> torch.Tensor:
        tensor = torch.from_numpy(self.data)
        return tensor if self.dtype is None else tensor.view(self.dtype).reshape(self.shape)


def pack(value: Any) -> Any:
    """``value`` (tensors in tuples, lists and dicts) with every tensor as bytes when they total
    at most :data:`PACK_LIMIT` bytes; larger batches are left to DataLoader's shared memory."""
    total = sum(t.numel() * t.element_size() for t in tensors_of(value))
    if total > PACK_LIMIT or total == 0:
        return value
    return map_values(value, _Packed, torch.Tensor)


def unpack(value: Any) -> Any:
    """The inverse of :func:`pack`."""
    return map_values(value, _Packed.tensor, _Packed)


def pin(value: Any) -> Any:
    """``value`` with every tensor in page-locked memory (for faster copies to an accelerator)."""
    return map_values(value, lambda t: t.pin_memory(), torch.Tensor)


def pin_available(asked: bool) -> bool:
    """Whether to pin: asked for and an accelerator exists (else a warning, as DataLoader does)."""
    if not asked:
        return False
    available = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if not available:
        warnings.warn("pin_memory is set but no accelerator is available: batches are not pinned", stacklevel=3)
    return available


_END = object()


class Receiver:
    """Takes the items of ``iterator`` on a background thread, ``convert`` s them there and hands
    them over in order, at most ``depth`` ahead (:meth:`take`). An exception raised by the
    iterator or ``convert`` is raised by the :meth:`take` that would have returned the item, and
    so is the death of a DataLoader worker process, as torch reports it (a RuntimeError, see
    :func:`~pipetrain.data.worker_deaths.lost_data_worker`), at the first take after it.

    The thread only calls ``next(iterator)`` and ``convert``: creating the iterator (which may draw
    random numbers) is the caller's business, on the caller's thread."""

    def __init__(self, iterator: Iterator[Any], convert: Callable[[Any], Any] = lambda item: item,
                 depth: int = 2, name: str = "pipetrain-data") -> None:
        self._replaced = keep_worker_deaths()
        self._iterator = iterator
        self._convert = convert
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._iterator:
                if not self._put((True, self._convert(item))):
                    return
            self._put((True, _END))
        except BaseException as error:  # noqa: BLE001 - handed to the training thread
            self._put((False, death_behind(error, self._iterator)))
        finally:
            self._iterator = None  # a DataLoader iterator shuts its workers down when dropped

    def take(self) -> tuple[bool, Any]:
        """``(True, item)``, or ``(False, None)`` once the iterator is exhausted."""
        if self._ended:
            return False, None
        while True:
            death = pending_death()
            if death is not None:  # a worker died: torch's own check would see it only seconds later
                self._ended = True
                raise death
            try:
                ok, item = self._queue.get(timeout=0.05)
                break
            except queue.Empty:
                continue
        if not ok:
            self._ended = True
            raise signal_report(item)
        if item is _END:
            self._ended = True
            return False, None
        return True, item

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking items (after the one under way) and let the iterator go."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)
        if self._replaced:  # the last receiver gives torch's SIGCHLD handler back
            self._replaced = False
            give_worker_deaths_back()



class _GroupsOf:
    """The sampler of :class:`WorkerPrefetcher`'s loader: ``order`` in tuples of ``size``
    consecutive updates, made as the loader asks for them (a long run's would be a list of
    100,000 tuples)."""

    def __init__(self, order: Sequence[int], size: int) -> None:
        self.order, self.size = order, size

    def __len__(self) -> int:
        return -(-len(self.order) // self.size)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        order, size = self.order, self.size
        return (tuple(order[i : i + size]) for i in range(0, len(order), size))


class _Groups:
    """Item ``(t1, t2, ...)``: the list ``[reads[t1], reads[t2], ...]``, read by one worker."""

    def __init__(self, reads: Any) -> None:
        self.reads = reads

    def __getitem__(self, updates: tuple[int, ...]) -> list[Any]:
        return [self.reads[update] for update in updates]


class WorkerPrefetcher:
    """``get(update)``: ``reads[update]`` read in DataLoader worker processes, the updates of
    ``order`` in turn (each once, in the order the rank reads them).

    ``reads`` is a map-style data set whose item ``t`` is update ``t``'s whole batch. One worker
    reads ``group`` consecutive updates of ``order`` in one go and sends them as one message: the
    cost of a message between processes (about 0.3-1 ms here) is then shared by ``group`` small
    batches. ``workers x prefetch_factor`` groups are under way at a time. A request for an update
    a little ahead of the stream waits for it and keeps the ones before it (up to ``keep``) for
    their own requests; one far ahead (a resumed run) restarts the stream there. ``get`` returns
    None for an update the stream cannot deliver any more (not in ``order``, or passed and not
    kept): the caller reads that one itself."""

    def __init__(self, reads: Any, order: Sequence[int], *, workers: int, pin_memory: bool = False,
                 prefetch_factor: int = 2, keep: int = 16, group: int = 1) -> None:
        if workers < 1 or group < 1:
            raise ValueError(f"WorkerPrefetcher needs at least one worker and a group of one, got {workers}, {group}")
        self._groups = _Groups(reads)
        self._order, self._position = _indexed(order)
        self._workers = workers
        self._prefetch_factor = prefetch_factor
        self._pin = pin_available(pin_memory)
        self._group = group
        self._keep = max(keep, group)
        self._kept: dict[int, Any] = {}
        self._stream: Receiver | None = None
        self._arrived: list[Any] = []  # the rest of the group taken last, in order
        self._next = 0  # position in order of the next update the stream delivers
        self._loader = DataLoader  # what every (re)start of the stream builds

    def _start(self, position: int) -> None:
        self._stop()
        groups = _GroupsOf(self._order[position:], self._group)
        with unpinned_workers(self._workers):
            loader = self._loader(
                self._groups, batch_size=None, sampler=groups, num_workers=self._workers,
                collate_fn=pack, prefetch_factor=self._prefetch_factor,
                generator=torch.Generator(),  # the workers' base seed is not drawn from the global generator
                worker_init_fn=settle_worker,
            )
            iterator = iter(loader)
        convert = (lambda item: pin(unpack(item))) if self._pin else unpack
        self._stream = Receiver(iterator, convert, depth=2)
        self._next = position

    def _stop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._arrived = []

    def _take(self) -> Any:
        if not self._arrived:
            assert self._stream is not None
            more, items = self._stream.take()
            if not more:
                raise RuntimeError("the data workers' stream ended early")
            self._arrived = list(reversed(items))
        return self._arrived.pop()

    def get(self, update: int) -> Any | None:
        """The batch of ``update``, or None (see the class docstring)."""
        position = self._position.get(update)
        if position is None:
            return None
        if update in self._kept:
            return self._kept.pop(update)
        if position < self._next and self._stream is not None:
            return None
        ahead = max(self._keep, 2 * self._workers * self._prefetch_factor * self._group)
        if self._stream is None or position > self._next + ahead:
            self._start(position)
        while True:
            item = self._take()
            here = self._order[self._next]
            self._next += 1
            if here == update:
                return item
            self._kept[here] = item
            if len(self._kept) > self._keep:
                self._kept.pop(next(iter(self._kept)))

    def close(self) -> None:
        """Stop the workers (after the reads under way)."""
        self._stop()
        self._kept.clear()
