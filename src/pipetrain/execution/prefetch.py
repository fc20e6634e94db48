"""Reading the next update's batch on a background thread while the pipeline runs.

Only stage 0 reads data, and a batch is read when its update's first microbatch enters the
pipeline: every other stage then waits for that read. A :class:`BatchPrefetcher` reads on one
background thread, in the order the rank will need the batches, always one ahead of use, so the
read overlaps the rank's computation and its waits for messages (torch and gloo release the GIL
there). All reads happen on that one thread, in order, so a data set or sampler is never read
from two threads at once.

Only a data set whose batch is a function of its indices may be read ahead (see
:func:`pipetrain.data.info.reads_by_index`): one that draws random numbers in ``__getitem__``
(augmentation) would interleave its draws with the training thread's, and a run would no longer
equal the emulator's. Such data sets are read in the training thread, when needed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

__all__ = ["BatchPrefetcher"]


class BatchPrefetcher:
    """``get(update)`` returns ``load(update)``, read on a background thread; asking for an update
    also starts reading the one that follows it in ``order`` (the updates this rank reads, each
    once, in the order it reads them). An update outside ``order`` is read when asked for."""

    def __init__(self, load: Callable[[int], Any], order: Sequence[int]) -> None:
        self._load = load
        self._following = dict(zip(order, order[1:]))
        self._pending: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="pipetrain-prefetch")

    def get(self, update: int) -> Any:
        """The batch of ``update`` (waiting for its read if it is still under way); a read that
        failed raises here, in the training thread."""
        if self._pool is None:
            raise RuntimeError("the prefetcher is closed")
        future = self._pending.pop(update, None)
        if future is None:
            future = self._pool.submit(self._load, update)
        following = self._following.get(update)
        if following is not None and following not in self._pending:
            self._pending[following] = self._pool.submit(self._load, following)
        return future.result()

    def close(self) -> None:
        """Drop the reads not yet started and stop the thread (after the read under way)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
            pool.shutdown(wait=True)
