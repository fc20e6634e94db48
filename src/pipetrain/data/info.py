"""What a model needs to know about a data set: input shape, class count, and batches."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch.utils.data import Dataset, Subset

from pipetrain.errors import ConfigError
from pipetrain.spec import describe_exception

__all__ = ["DataInfo", "dataset_info", "get_batch", "check_sample", "read_sample"]


class DataInfo(NamedTuple):
    """Sizes a model takes from its data: one sample's ``input_shape`` and ``num_classes``."""

    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def in_features(self) -> int:
        """Number of input features once a sample is flattened."""
        return math.prod(self.input_shape)


def check_sample(sample: object, where: str = "data set") -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, y)`` of one sample as tensors, or explain what a sample must look like."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ConfigError(
            f"{where}: a sample must be a pair (x, y) of a feature tensor and an integer label, "
            f"got {type(sample).__name__}"
            + (f" of length {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        )
    x, y = sample
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    y = torch.as_tensor(y)
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ConfigError(
            f"{where}: y must be an integer class label (a Python int or a 0-d integer tensor), or "
            f"an integer tensor of labels per position (e.g. next tokens); got a {tuple(y.shape)} "
            f"tensor of {y.dtype}"
        )
    return x, y


IGNORE_INDEX = -100  # a label that counts for nothing (pipetrain.models.loss.IGNORE_INDEX)


def _class_count(labels: torch.Tensor) -> int:
    """One more than the largest label; -100 (ignored: padding, unmasked tokens) is allowed."""
    counted = labels[labels != IGNORE_INDEX]
    if labels.numel() and not counted.numel():
        raise ConfigError("every label of the data set is -100 (ignored): there is nothing to learn")
    if counted.numel() and int(counted.min()) < 0:
        raise ConfigError(
            f"data set has a negative class label ({int(counted.min())}); labels must be 0..C-1, or -100 for "
            f"targets that count for nothing (PyTorch's ignore_index)"
        )
    return int(counted.max()) + 1 if counted.numel() else 1


def dataset_info(dataset: Dataset) -> DataInfo:
    """Input shape of one sample and the class count of ``dataset``.

    The class count is ``dataset.num_classes`` when the data set has it (built-ins do), else one
    more than the largest label (read from ``dataset.targets`` when present, else by visiting
    every sample). Labels of -100 are ignored targets (padding, unmasked tokens), not classes.
    """
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise ConfigError("data set has no len(): pipetrain needs a map-style Dataset") from error
    if n == 0:
        raise ConfigError("data set is empty")
    x, _ = check_sample(read_sample(dataset, 0))
    num_classes = getattr(dataset, "num_classes", None)
    if num_classes is None and isinstance(dataset, Subset):
        num_classes = getattr(dataset.dataset, "num_classes", None)
    if num_classes is None:
        targets = getattr(dataset, "targets", None)
        if targets is not None:
            labels = torch.as_tensor(targets)
        elif hasattr(dataset, "tensors") and len(dataset.tensors) == 2:  # type: ignore[attr-defined]
            labels = dataset.tensors[1]  # type: ignore[attr-defined]
        else:
            labels = torch.stack([check_sample(read_sample(dataset, i))[1] for i in range(n)])
        num_classes = _class_count(labels)
    return DataInfo(tuple(int(s) for s in x.shape), int(num_classes))


def read_sample(dataset: Dataset, index: int) -> object:
    """``dataset[index]``; an exception of the data set's own code becomes one ConfigError naming
    the data set's class and the index (the prefetcher and the workers pass it on as it is)."""
    try:
        return dataset[index]
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's __getitem__ may raise anything
        inner, position = dataset, index  # name the user's data set and its index, not a Subset's
        try:
            while isinstance(inner, Subset):
                inner, position = inner.dataset, int(inner.indices[position])
        except Exception:  # noqa: BLE001 - the Subset itself is broken: name it
            inner, position = dataset, index
        raise ConfigError(
            f"data set {type(inner).__qualname__}: reading sample {position} raised {describe_exception(error)}"
        ) from None


def _read_batch(dataset: Dataset, index: torch.Tensor):
    """``dataset.batch(index)``, with an exception of its code named as :func:`read_sample` does."""
    try:
        return dataset.batch(index)  # type: ignore[attr-defined]
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001
        shown = index.tolist()
        shown = shown if len(shown) <= 8 else shown[:8] + ["..."]
        raise ConfigError(
            f"data set {type(dataset).__qualname__}: batch({shown}) raised {describe_exception(error)}"
        ) from None


def reads_by_index(dataset: Dataset) -> bool:
    """Whether :func:`get_batch` reads ``dataset`` in one indexing operation (a data set of two
    tensors, or one with a ``batch(indices)`` method): its batches are then a function of their
    indices alone, and may be read ahead on another thread. Others are read sample by sample
    through ``__getitem__``, which may draw random numbers (augmentation)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    tensors = getattr(dataset, "tensors", None)
    return callable(getattr(dataset, "batch", None)) or (isinstance(tensors, tuple) and len(tensors) == 2)


def get_batch(dataset: Dataset, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the samples ``indices`` of ``dataset`` into ``(x, y)`` with a leading batch dimension.

    A data set with a ``batch(indices) -> (x, y)`` method builds the batch itself (``text``: it
    gathers the windows and, with ``min_length``, cuts the batch to a length drawn from the
    indices; build each update's whole batch with one call, then split it into microbatches). A
    data set of two tensors (built-ins, TensorDataset) is indexed in one operation; any other is
    read sample by sample. Labels come back as int64.
    """
    index = torch.as_tensor(indices, dtype=torch.int64)
    while isinstance(dataset, Subset):
        index = torch.as_tensor(dataset.indices, dtype=torch.int64)[index]
        dataset = dataset.dataset
    batch = getattr(dataset, "batch", None)
    if callable(batch):
        x, y = _read_batch(dataset, index)
        return x, y.to(torch.int64)
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:
        return tensors[0][index], tensors[1][index].to(torch.int64)
    pairs = [check_sample(read_sample(dataset, int(i))) for i in index]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]).to(torch.int64)
