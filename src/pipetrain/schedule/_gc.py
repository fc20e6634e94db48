"""Pausing Python's cyclic garbage collector around passes that allocate many small tuples."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Actions are tuples of ints and enum members and cannot form cycles; without this pause,
    building a schedule of 10^5..10^6 actions spends most of its time in repeated collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
