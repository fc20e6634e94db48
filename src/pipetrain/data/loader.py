"""A user's DataLoader as the run's data: its batches, one epoch after another, are the updates.

The loader keeps everything it was built with (its sampler, ``num_workers``, ``pin_memory``,
``persistent_workers``, collate function); pipetrain only reads it, on the rank that holds stage
0, in order: the loader's i-th full batch of the run is update i's batch.

* **Batch size.** Every update has ``B`` samples, ``loader.batch_size`` (or the size of its first
  batch when it has none, as with a ``batch_sampler``): the microbatches and the loss scaling of
  each update are cut from ``B``. A shorter batch (the last one of an epoch when ``drop_last`` is
  False and ``B`` does not divide the data) is skipped, with one warning: build the loader with
  ``drop_last=True`` to not read it at all. A larger batch is an error.
* **Epochs.** When an epoch ends the next begins (``sampler.set_epoch(e)`` first when the sampler
  has it, as ``DistributedSampler`` does); :attr:`LoaderBatches.updates_per_epoch` counts its full
  batches, from the sampler's length, for ``epochs=`` runs. A loader without a length (an
  ``IterableDataset``) needs a number of steps.
* **Seeds.** Epoch e's iterator is made under ``data_seed(seed, e, stream=1)`` (a shuffling
  sampler without its own generator, and the workers' base seed, draw from it), and with
  ``num_workers=0`` update t's batch is read under ``data_seed(seed, t)``, the caller's generators
  restored after: two identical runs read identical batches, and the emulator equals the runtime.
  With worker processes, the loader seeds each worker once per epoch (torch's rule); the batches
  are still the same from run to run, though not the same as with ``num_workers=0``.
* **Reading ahead.** The loader's own workers read ahead; a receiving thread takes their batches
  so that the training thread only picks one up. With ``num_workers=0`` batches are read on the
  training thread when needed (as the loader itself would). The loader's ``worker_init_fn`` is
  wrapped (:func:`~pipetrain.data.worker_setup.settle_worker`): its workers first close the TCP
  sockets of a distributed rank that the fork duplicated (held there, they hid the rank's death
  from its peers for seconds) and, on a rank that pipetrain's launcher pinned to its own cores,
  may run on any core: pinned beside the rank they fall behind whenever its core is busy.
* **Going back.** Updates are asked for in increasing order; the last ``keep`` batches are kept
  for a request that comes a little late (stage 0's replicas take turns). A run that starts at a
  later update (resumed from a checkpoint) reads the batches before it and drops them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from pipetrain.data.info import DataInfo, DataReadError, check_sample, class_labels, dataset_info
from pipetrain.data.prefetch import Receiver
from pipetrain.data.worker_deaths import lost_data_worker
from pipetrain.data.worker_setup import Unpinned, unpinned_workers
from pipetrain.data.seeding import data_seed, seeded
from pipetrain.errors import ConfigError, PipetrainError, option
from pipetrain.spec import describe_exception
from pipetrain.structure import cast_floating, first_tensor

__all__ = ["LoaderBatches", "loader_info"]


def loader_info(loader: DataLoader, where: str = "the DataLoader") -> DataInfo:
    """What the model needs to know of a DataLoader's data: :func:`~pipetrain.data.info.dataset_info`
    of its (map-style) data set, one sample read; an ``IterableDataset`` must declare
    ``num_classes`` when its targets are class labels (others have none), and gives the input shape
    of its first sample."""
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset):
        return dataset_info(dataset)
    num_classes = getattr(dataset, "num_classes", None)
    with seeded(0):
        first = next(iter(dataset), None)
    if first is None:
        raise ConfigError(f"{where}'s IterableDataset yielded no sample")
    x, y = check_sample(first, where)
    if num_classes is None and class_labels(y):
        raise ConfigError(
            f"{where} reads an IterableDataset ({type(dataset).__name__}) of class labels: give it a num_classes "
            "attribute, the class count the model is built for"
        )
    return DataInfo(tuple(int(s) for s in first_tensor(x).shape), None if num_classes is None else int(num_classes))


class LoaderBatches:
    """``batch(update)``: the ``update``-th full batch ``(x, y)`` of ``loader`` over its epochs
    (see the module docstring); ``dtype`` casts floating-point inputs; ``batch_size``: the run's
    (it must match the loader's). :meth:`close` at the end."""

    def __init__(self, loader: Any, *, seed: int = 0, dtype: torch.dtype | None = None, batch_size: int | None = None,
                 keep: int = 16) -> None:
        if not hasattr(loader, "__iter__") or hasattr(loader, "__next__"):
            raise ConfigError(
                f"the data must be a DataLoader (or another object that starts an epoch with iter()), got a "
                f"{type(loader).__name__}" + ("; pass the loader itself, not iter(loader)" if hasattr(loader, "__next__") else "")
            )
        self.loader = loader
        self.seed = seed
        self.dtype = dtype
        self.keep = keep
        self.batch_size: int | None = getattr(loader, "batch_size", None)
        if batch_size is not None:
            if self.batch_size is not None and self.batch_size != batch_size:
                raise ConfigError(
                    f"the DataLoader's batch_size is {self.batch_size} but the run's batch size is {batch_size}: "
                    f"give {option('batch_size', self.batch_size)} (one loader batch is one update)"
                )
            self.batch_size = batch_size
        self.epoch = 0  # the epoch being read
        self.skipped = 0  # short batches dropped
        self._iterator: Iterator[Any] | None = None
        self._receiver: Any = None
        self._next = 0  # the update the next full batch becomes
        self._kept: dict[int, tuple[Any, torch.Tensor]] = {}
        self._epoch_batches = 0  # full batches of the epoch being read
        self._threaded = int(getattr(loader, "num_workers", 0) or 0) > 0
        if self._threaded and hasattr(loader, "worker_init_fn"):
            if not isinstance(loader.worker_init_fn, Unpinned):  # see the module docstring, "Reading ahead"
                loader.worker_init_fn = Unpinned(loader.worker_init_fn)

    def __repr__(self) -> str:
        return f"LoaderBatches({type(self.loader).__name__}, batch_size={self.batch_size}, seed={self.seed})"

    @property
    def reading(self) -> str:
        """How batches are read, in words (for the run's report)."""
        workers = int(getattr(self.loader, "num_workers", 0) or 0)
        if workers:
            return f"from the DataLoader, in its {workers} worker process{'es' * (workers > 1)}"
        return "from the DataLoader, on the training thread"

    @property
    def read_ahead(self) -> bool:
        return self._threaded

    @property
    def updates_per_epoch(self) -> int | None:
        """Full batches per epoch when the loader says (None when it has no length)."""
        loader = self.loader
        batch_size = getattr(loader, "batch_size", None)
        dataset = getattr(loader, "dataset", None)
        if batch_size is not None and not isinstance(dataset, IterableDataset):
            sampler = getattr(loader, "sampler", None)
            try:
                return len(sampler) // batch_size  # type: ignore[arg-type]
            except TypeError:
                pass
        try:
            return len(loader)
        except TypeError:
            return None

    def steps_for_epochs(self, epochs: float) -> int:
        """Updates in ``epochs`` passes over the loader: ``ceil(epochs * updates_per_epoch)``."""
        per_epoch = self.updates_per_epoch
        if per_epoch is None:
            raise ConfigError("the DataLoader has no length (an IterableDataset?): give the number of steps instead of epochs")
        if per_epoch == 0:
            raise ConfigError(f"the DataLoader has no full batch of {self.batch_size} samples in an epoch")
        if epochs <= 0:
            raise ConfigError(f"epochs must be positive, got {epochs}")
        return math.ceil(epochs * per_epoch - 1e-9)

    # -- reading ---------------------------------------------------------------------------------

    def _start_epoch(self) -> None:
        for sampler in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(self.epoch)

        workers = getattr(self.loader, "num_workers", 0)
        with seeded(data_seed(self.seed, self.epoch, stream=1)), unpinned_workers(workers):
            iterator = iter(self.loader)
        self._epoch_batches = 0
        if self._threaded:
            self._receiver = Receiver(iterator, depth=2, name="pipetrain-loader")
        else:
            self._iterator = iterator

    def _end_epoch(self) -> None:
        if self._epoch_batches == 0:
            raise ConfigError(
                f"the DataLoader yielded no batch of {self.batch_size} samples in epoch {self.epoch}; "
                "it needs at least one full batch per epoch"
            )
        self.epoch += 1
        self._close_epoch()

    def _close_epoch(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = None
        self._iterator = None

    def _raw(self) -> tuple[bool, Any]:
        """``(True, batch)`` of the current epoch, or ``(False, None)`` at its end."""
        if self._receiver is None and self._iterator is None:
            self._start_epoch()
        try:
            if self._receiver is not None:
                return self._receiver.take()
            with seeded(data_seed(self.seed, self._next)):
                try:
                    return True, next(self._iterator)  # type: ignore[arg-type]
                except StopIteration:
                    return False, None
        except PipetrainError:
            raise
        except Exception as error:
            lost = lost_data_worker(error)  # a worker process that died is a fault, not bad data
            if lost is not None:
                raise lost from None
            lines = [line for line in str(error).splitlines() if line.strip()]
            # from a worker, torch re-raises with the worker's traceback as text: its last line says what
            cause = lines[-1].strip() if len(lines) > 1 else describe_exception(error)
            raise DataReadError(f"reading the batch of update {self._next} from the DataLoader failed: {cause}") from None

    def _pair(self, raw: Any) -> tuple[Any, torch.Tensor]:
        if not isinstance(raw, (tuple, list)) or len(raw) != 2:
            raise ConfigError(
                f"each batch of the DataLoader must be a pair (inputs, targets), got a {type(raw).__name__}"
                + (f" of length {len(raw)}" if isinstance(raw, (tuple, list)) else "")
            )
        x, y = raw
        first = first_tensor(y)
        if first is None or first.dim() == 0:
            raise ConfigError(
                f"the targets of a DataLoader batch must be a tensor with a batch dimension (or a tuple, list or "
                f"dict of them), got {type(y).__name__}" + ("" if first is None else " of 0-d tensors")
            )
        return cast_floating(x, self.dtype), y  # the targets as the loader made them

    def _next_full(self) -> tuple[Any, torch.Tensor]:
        while True:
            more, raw = self._raw()
            if not more:
                self._end_epoch()
                continue
            x, y = self._pair(raw)
            samples = int(first_tensor(y).shape[0])
            if self.batch_size is None:
                self.batch_size = samples
            if samples == self.batch_size:
                self._epoch_batches += 1
                return x, y
            if samples > self.batch_size:
                raise ConfigError(
                    f"the DataLoader gave a batch of {samples} samples after batches of {self.batch_size}; "
                    "every update must have the same number of samples"
                )
            if self.skipped == 0:
                warnings.warn(
                    f"skipping a batch of {samples} samples (the last of an epoch?): every update has "
                    f"{self.batch_size}; build the DataLoader with drop_last=True to not read it",
                    stacklevel=3,
                )
            self.skipped += 1

    def batch(self, update: int) -> tuple[Any, torch.Tensor]:
        """Update ``update``'s batch: reads on until the loader has given it (see "Going back")."""
        if update in self._kept:
            return self._kept[update]
        if update < self._next:
            raise ConfigError(
                f"update {update}'s batch was read {self._next - update} updates ago and not kept: a DataLoader "
                f"is read in order (keep={self.keep} batches are kept for late requests)"
            )
        while True:
            batch = self._next_full()
            here = self._next
            self._next += 1
            if here > update - self.keep:
                self._kept[here] = batch
                while len(self._kept) > self.keep:
                    self._kept.pop(next(iter(self._kept)))
            if here == update:
                return batch

    def close(self) -> None:
        """Stop reading (the loader's own workers end with its iterator, unless persistent)."""
        self._close_epoch()
        self._kept.clear()
