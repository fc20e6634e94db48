"""Which samples each optimizer update reads: a pure function of (seed, shuffle, B, update number).

The data is one endless stream of epochs. Epoch ``e`` visits all ``N`` samples once, in dataset
order with ``shuffle=False``, or in ``torch.randperm(N)`` order drawn from a ``torch.Generator``
seeded with :func:`epoch_seed` ``(seed, e)`` with ``shuffle=True``. Update ``t`` consumes stream
positions ``t*B .. (t+1)*B - 1``; a batch may straddle two epochs (no sample is dropped or
repeated within an epoch). Example, N = 5, B = 2, no shuffle::

    update t   0      1      2      3      4
    indices    0 1    2 3    4 0    1 2    3 4

Because the indices of update ``t`` depend on nothing but ``t``, a run resumed from a checkpoint
taken after update ``t`` continues with exactly the samples an uninterrupted run would have used.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from pipetrain.errors import ConfigError, option

__all__ = ["BatchSampler", "epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the shuffling generator of ``epoch``, mixed from ``(seed, epoch)`` into 32 bits.

    ``int(numpy.random.SeedSequence([seed, epoch]).generate_state(1)[0])``: torch's CPU generator
    keeps only the low 32 bits of a seed, so a plain ``seed * 2**32 + epoch`` would ignore ``seed``.
    """
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class BatchSampler:
    """Sample indices of every update of a run, reproducible and resumable from any update.

    >>> s = BatchSampler(5, 2, shuffle=False)
    >>> [s.indices(t).tolist() for t in range(3)]
    [[0, 1], [2, 3], [4, 0]]
    """

    def __init__(self, data: Dataset | int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        num_samples = data if isinstance(data, int) else len(data)  # type: ignore[arg-type]
        if num_samples < 1:
            raise ConfigError("the data set is empty: nothing to sample")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"{option('batch_size')} must be a positive integer, got {batch_size!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ConfigError(f"{option('seed')} must be an integer in [0, 2**32), got {seed!r}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._cache: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"BatchSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )

    @property
    def steps_per_epoch(self) -> float:
        """Updates per pass over the data, ``N / B`` (fractional when B does not divide N)."""
        return self.num_samples / self.batch_size

    def steps_for_epochs(self, epochs: float) -> int:
        """Updates needed to consume ``epochs`` passes over the data: ``ceil(epochs * N / B)``."""
        if epochs <= 0:
            raise ConfigError(f"{option('epochs')} must be positive, got {epochs}")
        return math.ceil(epochs * self.num_samples / self.batch_size - 1e-9)

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, offset)`` of the first sample of update ``step`` in the stream."""
        start = step * self.batch_size
        return divmod(start, self.num_samples)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The order (int64 indices, a permutation of ``0..N-1``) in which ``epoch`` visits samples."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not self.shuffle:
            return torch.arange(self.num_samples, dtype=torch.int64)
        order = self._cache.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = order
        return order

    def indices(self, step: int) -> torch.Tensor:
        """The ``B`` sample indices (int64) of update ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"update number must be >= 0, got {step}")
        if not self.shuffle:  # positions t*B .. (t+1)*B-1 of 0, 1, .., N-1, 0, 1, ..: O(B), not O(N)
            return (torch.arange(self.batch_size, dtype=torch.int64) + step * self.batch_size) % self.num_samples
        epoch, offset = self.position(step)
        parts = []
        need = self.batch_size
        while need > 0:
            order = self.epoch_order(epoch)
            take = order[offset : offset + need]
            parts.append(take)
            need -= take.numel()
            epoch, offset = epoch + 1, 0
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def iter_from(self, start: int = 0, steps: int | None = None) -> Iterator[torch.Tensor]:
        """Indices of updates ``start, start+1, ...`` (``steps`` of them, or without end)."""
        step = start
        while steps is None or step < start + steps:
            yield self.indices(step)
            step += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_from(0)

    def state_dict(self, step: int) -> dict[str, int | bool]:
        """What a checkpoint must record to resume sampling after ``step`` updates."""
        return {
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "step": step,
        }

    def check_resume(self, state: dict[str, int | bool]) -> int:
        """Validate a :meth:`state_dict` against this sampler; return the update to resume at."""
        for key in ("num_samples", "batch_size", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"cannot resume: the checkpoint was taken with {key}={state.get(key)!r} but "
                    f"this run has {key}={getattr(self, key)!r}; use the same data, {option('batch_size')}, "
                    f"{option('seed')} and {option('shuffle')} setting as the original run"
                )
        return int(state["step"])
