"""One seed per update for every random generator a data set can draw from.

A data set that augments in ``__getitem__`` (a random crop, a flip) draws from torch's, numpy's or
Python's global generator. Update ``t``'s batch is read under :func:`data_seed` ``(seed, t)``
applied to all three (:func:`seed_generators`), in whichever process reads it: a DataLoader
worker, or the training thread (where :func:`seeded` puts the training thread's own generator
states back afterwards). The batch of update ``t`` is then a function of ``(seed, t)`` alone, the
same in two identical runs, in the emulator and the runtime, with any number of worker processes.

Not covered: generators a data set makes itself (``numpy.random.default_rng()`` without a seed,
``torch.Generator()`` seeded from the clock) and accelerator generators.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

__all__ = ["data_seed", "seed_generators", "seeded"]

_DATA = 0x64617461  # "data": keeps these seeds apart from the shuffling seeds of pipetrain.data.sampler


_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def data_seed(seed: int, update: int, stream: int = 0) -> int:
    """The 32-bit seed (the widest all three generators accept) of update ``update``'s batch in a
    run with ``seed``: the low 32 bits of ``mix(mix(mix(0x64617461 + stream) ^ seed) ^ update)``,
    ``mix`` SplitMix64's finaliser (a microsecond, where numpy's SeedSequence takes ten).
    ``stream`` keeps other uses apart (1: the start of epoch ``update`` of a user's DataLoader,
    2: held-out batch ``update``)."""
    return _mix(_mix(_mix(_DATA + stream) ^ (seed & _MASK)) ^ (update & _MASK)) & 0xFFFFFFFF


def seed_generators(seed: int) -> None:
    """Seed torch's CPU generator, numpy's global generator and Python's ``random`` with ``seed``."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block under :func:`seed_generators` ``(seed)``, then restore the three generators'
    states: the caller's own random streams (dropout seeds, shuffling) go on as if nothing ran."""
    torch_state = torch.default_generator.get_state()
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    seed_generators(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
