"""Keeping Python's cyclic garbage collector out of start-up, schedule building and the training loop.

The collector's oldest generation walks every object alive, and a process that has imported
PyTorch holds millions: one full collection costs 70-100 ms on the project's CPU machine. Three
places pay it for nothing:

* **Start-up.** Importing PyTorch and pipetrain's training modules triggers several full
  collections, which find nothing (modules live as long as the process). A process that loads
  them under :func:`loading` (or :func:`pause_for_loading` ... :func:`loaded` where the loading
  spans two functions: a spawned worker pauses in :func:`pipetrain.runtime.settle.settle` and
  resumes once its function is unpickled) skips them, and freezes what it loaded out of the
  collector's sight. The embedded default run (`pipetrain train --steps 3 --stages 2`) takes
  0.83 of the time it took without (benchmarks/RESULTS.md section 20).
* **Building a schedule** (:func:`gc_paused`): actions are tuples of ints and enum members and
  cannot form cycles; building 10^5..10^6 of them otherwise spends most of its time in repeated
  collections.
* **The training loop** (:func:`setup_heap_frozen`): setup leaves a large heap behind (the
  schedule's programs, the message index, the model). Once the loop has allocated enough, an
  oldest-generation collection may run and stop the rank for 100 ms or more: in a 60-update 1F1B
  run of the overhead-bound benchmark (benchmarks/vs_torch_pipelining.py) each rank stopped once
  for 111-116 ms, half a second in, 2.5 % of the run, and in a pipeline a stalled rank stalls
  every rank. Freezing the heap that setup built takes it out of sight; what the loop allocates is
  collected as usual.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["gc_paused", "loading", "pause_for_loading", "loaded", "setup_heap_frozen"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No collection inside the block (one that allocates many objects without cycles)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def pause_for_loading() -> None:
    """The first step of a process that is about to import its libraries: no collection until
    :func:`loaded`."""
    gc.disable()


def loaded() -> None:
    """The libraries are imported: freeze every object alive out of the collector's sight (they
    live as long as the process) and let it run again."""
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Import inside the block: no collection meanwhile, and what is alive at its end frozen."""
    was_enabled = gc.isenabled()
    pause_for_loading()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def setup_heap_frozen() -> Iterator[None]:
    """Freeze every object alive (``gc.freeze``) until the block ends, after collecting the young
    generations (a full collection would cost 70 ms or more per run: setup's garbage in the
    oldest generation waits for the end of the block instead). Its end unfreezes everything, what
    :func:`loaded` froze too, so that a script that trains several times frees each run's setup."""
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
