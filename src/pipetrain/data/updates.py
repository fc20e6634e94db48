"""Update t's whole batch as one item, read under update t's seed in whichever process reads it."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from pipetrain.data.info import DataReadError, get_batch
from pipetrain.data.seeding import data_seed, seed_generators, seeded
from pipetrain.errors import PipetrainError
from pipetrain.spec import describe_exception
from pipetrain.structure import cast_floating

__all__ = ["UpdateBatches", "DataReadError"]


class _Failed:
    """What a worker process returns instead of a batch whose read raised: the message travels
    as text (the exception object may not pickle), and the training thread raises it."""

    def __init__(self, message: str) -> None:
        self.message = message


class UpdateBatches(Dataset):
    """A map-style data set whose item ``t`` is update ``t``'s batch ``(x, y)`` of ``dataset``:
    the samples ``indices_of_update(t)``, read with :func:`~pipetrain.data.info.get_batch` under
    :func:`~pipetrain.data.seeding.data_seed` ``(seed, t)``, floating-point inputs cast to
    ``dtype``. Item ``t`` is the same bytes in a DataLoader worker (``reads[t]``, which seeds the
    worker's generators) and on the training thread (:meth:`read`, which restores them after)."""

    def __init__(
        self,
        dataset: Dataset,
        indices_of_update: Callable[[int], torch.Tensor],
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.dataset = dataset
        self.indices_of_update = indices_of_update
        self.seed = seed
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"UpdateBatches({type(self.dataset).__name__}, seed={self.seed})"

    def _batch(self, update: int) -> tuple[Any, torch.Tensor]:
        x, y = get_batch(self.dataset, self.indices_of_update(update))
        return cast_floating(x, self.dtype), y

    def _message(self, update: int, error: BaseException) -> str:
        cause = (str(error) if isinstance(error, PipetrainError)
                 else f"data set {type(self.dataset).__qualname__} raised {describe_exception(error)}")
        return f"reading the batch of update {update} failed: {cause}"

    def __getitem__(self, update: int) -> Any:
        """In a worker process: seed its generators for ``update``, read the batch. A read that
        raises comes back as a marker that :func:`raise_failed` turns into a :class:`DataReadError`."""
        seed_generators(data_seed(self.seed, update))
        try:
            return self._batch(update)
        except Exception as error:  # noqa: BLE001 - reported as one line in the training thread
            return _Failed(self._message(update, error))

    def read(self, update: int) -> tuple[Any, torch.Tensor]:
        """Update ``update``'s batch, read here under its seed; the caller's generators are left
        as they were."""
        with seeded(data_seed(self.seed, update)):
            return self.read_unseeded(update)

    def read_unseeded(self, update: int) -> tuple[Any, torch.Tensor]:
        """Update ``update``'s batch without touching any generator: for data sets read by index
        (their batch is a function of the indices), so any thread may call it."""
        try:
            return self._batch(update)
        except Exception as error:
            raise DataReadError(self._message(update, error)) from error


def raise_failed(item: Any) -> Any:
    """``item``, unless it is a failed read's marker: then its :class:`DataReadError`."""
    if isinstance(item, _Failed):
        raise DataReadError(item.message)
    return item
