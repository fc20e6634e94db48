"""Which training samples each pipeline unit (microbatch) carries, and its share of the loss.

Update t consumes the B samples the batch sampler gives for t. Those are split into U units (the
microbatches of a synchronous step, or the minibatches accumulated into one asynchronous update)
the way ``torch.tensor_split`` splits, so unit ``k`` is part ``k mod U`` of update ``k // U`` (every
tensor of a structured input, :mod:`pipetrain.structure`, along its first dimension).
Each unit's loss is its mean loss times ``n_k / B``: summed over the units of an update this is
exactly the mean over the whole batch, the reduction of non-pipelined training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from torch.utils.data import Dataset

from pipetrain.data import get_batch as default_get_batch
from pipetrain.data.info import reads_by_index
from pipetrain.data.prefetch import BatchPrefetcher
from pipetrain.errors import ConfigError, option
from pipetrain.structure import rows

__all__ = ["UnitLayout", "UnitData", "BatchSource"]


@dataclass(frozen=True)
class UnitLayout:
    """``batch_size`` samples per update, split into ``units_per_update`` units."""

    batch_size: int
    units_per_update: int

    def __post_init__(self) -> None:
        if self.batch_size < self.units_per_update:
            raise ConfigError(
                f"a batch of {self.batch_size} samples cannot be split into {self.units_per_update} microbatches; "
                f"use {option('batch_size', self.units_per_update)} or more, or fewer {option('microbatches')}"
            )

    def bounds(self, unit: int) -> tuple[int, int, int]:
        """``(update, start, stop)``: unit ``unit`` is samples ``start:stop`` of that update's batch."""
        update, part = divmod(unit, self.units_per_update)
        base, extra = divmod(self.batch_size, self.units_per_update)
        start = part * base + min(part, extra)
        stop = start + base + (1 if part < extra else 0)
        return update, start, stop

    def loss_scale(self, unit: int) -> float:
        _, start, stop = self.bounds(unit)
        return (stop - start) / self.batch_size


class BatchSource(Protocol):
    """Where a :class:`UnitData` takes each update's whole batch from (for example
    :class:`pipetrain.data.DatasetBatches` or :class:`pipetrain.data.LoaderBatches`)."""

    def batch(self, update: int) -> tuple[Any, Any]: ...

    def close(self) -> None: ...


class _Calls:
    """A batch source calling ``get_batch(dataset, indices_of_update(t))``; with ``prefetch`` and
    a data set read by index, on a background thread one update ahead."""

    def __init__(self, dataset, indices_of_update, get_batch, prefetch) -> None:
        self.dataset = dataset
        self.indices_of_update = indices_of_update
        self.get_batch = get_batch or default_get_batch
        self._prefetcher: BatchPrefetcher | None = None
        if prefetch is not None and reads_by_index(dataset):
            self._prefetcher = BatchPrefetcher(self._read, prefetch)

    @property
    def read_ahead(self) -> bool:
        return self._prefetcher is not None

    def _read(self, update: int) -> tuple[Any, Any]:
        return self.get_batch(self.dataset, self.indices_of_update(update))

    def batch(self, update: int) -> tuple[Any, Any]:
        return self._read(update) if self._prefetcher is None else self._prefetcher.get(update)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()


class UnitData:
    """Inputs and targets of each unit, cut from each update's batch (cached per update).

    The batches come from ``batches`` (a :class:`BatchSource`, see :meth:`of`), or else from
    ``get_batch(dataset, indices_of_update(t))``: with ``prefetch`` (the updates this rank reads,
    in the order it reads them) and a data set read by index, a
    :class:`~pipetrain.data.prefetch.BatchPrefetcher` reads each one on a background thread
    one update ahead."""

    def __init__(
        self,
        dataset: Dataset | None,
        layout: UnitLayout,
        indices_of_update: Callable[[int], Any] | None = None,
        get_batch: Callable[[Dataset, Any], tuple[Any, Any]] | None = None,
        prefetch: Sequence[int] | None = None,
        *,
        batches: BatchSource | None = None,
    ) -> None:
        self.layout = layout
        if batches is None:
            if indices_of_update is None:
                raise TypeError("UnitData needs indices_of_update (or batches=)")
            batches = _Calls(dataset, indices_of_update, get_batch, prefetch)
        self.batches = batches
        self._cached: tuple[int, Any, Any] | None = None

    @classmethod
    def of(cls, batches: BatchSource, layout: UnitLayout) -> "UnitData":
        """The units of the batches ``batches.batch(t)`` (update ``t``), split by ``layout``."""
        return cls(None, layout, batches=batches)

    @property
    def prefetching(self) -> bool:
        """Whether batches are read ahead (on a background thread or in worker processes)."""
        return bool(getattr(self.batches, "read_ahead", False))

    def batch(self, update: int) -> tuple[Any, Any]:
        if self._cached is None or self._cached[0] != update:
            x, y = self.batches.batch(update)
            self._cached = (update, x, y)
        return self._cached[1], self._cached[2]

    def close(self) -> None:
        """Stop reading ahead (a no-op without it)."""
        self.batches.close()

    def unit(self, unit: int) -> tuple[Any, Any]:
        update, start, stop = self.layout.bounds(unit)
        x, y = self.batch(update)
        if start == 0 and stop == self.layout.batch_size:
            return x, y
        return rows(x, start, stop), rows(y, start, stop)
