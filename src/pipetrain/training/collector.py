"""Keeping Python's cyclic garbage collector out of the training loop.

Setup leaves a large heap behind: the schedule's programs (an object per action of every rank),
the message index, the model, imported libraries. Python's oldest-generation collection walks all
of it, and once the loop has allocated enough it may run, stopping the rank for 100 ms or more. In
a 60-update 1F1B run of the overhead-bound benchmark (benchmarks/vs_torch_pipelining.py) each rank
stopped once for 111-116 ms, half a second in: 2.5 % of the run, and in a pipeline a stalled rank
stalls every rank. Whether and when it happens depends on the run's length. Freezing the heap
that setup built takes it out of the collector's sight; what the loop allocates is collected as
usual.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["setup_heap_frozen"]


@contextmanager
def setup_heap_frozen() -> Iterator[None]:
    """Freeze every object alive (``gc.freeze``) until the block ends, after collecting the young
    generations (a full collection would cost 70 ms or more per run: setup's garbage in the
    oldest generation waits for the end of the block instead)."""
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
