"""What a model needs to know about a data set (input shape, class count) and reading its batches."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from pipetrain.data.seeding import seeded
from pipetrain.errors import ConfigError
from pipetrain.spec import describe_exception
from pipetrain.structure import describe, first_tensor, flatten, leaf_paths, stack

__all__ = ["DataInfo", "DataReadError", "dataset_info", "get_batch", "check_sample", "class_labels", "read_sample",
           "stack_samples", "reads_by_index"]


class DataReadError(ConfigError):
    """Reading a training batch failed: the update, and what the data set's code raised."""


class DataInfo(NamedTuple):
    """Sizes a model takes from its data: one sample's ``input_shape`` and ``num_classes``.

    ``num_classes`` is None when the targets are not class labels (floating-point regression
    targets, a structure of targets) and the data set declares no ``num_classes``: a model sized by
    a class count cannot be built for such data. For a structured ``x`` (a tuple, list or dict of tensors, :mod:`pipetrain.structure`),
    ``input_shape`` is the shape of its first tensor (the source sequence of ``((src, tgt_in), tgt)``,
    ``input_ids`` of a dict that starts with them)."""

    input_shape: tuple[int, ...]
    num_classes: int | None

    @property
    def in_features(self) -> int:
        """Number of input features once a sample is flattened."""
        return math.prod(self.input_shape)


def _structured(y: Any) -> bool:
    """Whether a target is a structure of targets (a dict, a tuple, or a list holding tensors or
    containers) rather than one value (a tensor, a number, a list of numbers)."""
    return isinstance(y, (dict, tuple)) or (
        isinstance(y, list) and any(isinstance(item, (torch.Tensor, tuple, list, dict)) for item in y))


def _target(y: Any, where: str) -> Any:
    """``y`` as the loss will get it: a tensor kept as it is (any dtype: class labels, regression
    values, masks); a number, a list of numbers or an array as ``torch.as_tensor`` makes it (a
    Python int int64, a float float32); a dict, tuple or list of those leaf by leaf. Anything else
    (a string, None, a ragged list) is refused."""
    if isinstance(y, torch.Tensor):
        return y
    if _structured(y):
        if not y:
            raise ConfigError(f"{where}: y is an empty {type(y).__name__}: a target must hold at least one value")
        if isinstance(y, dict):
            return {key: _target(value, where) for key, value in y.items()}
        parts = [_target(item, where) for item in y]
        return type(y)(*parts) if hasattr(y, "_fields") else type(y)(parts)
    try:
        return torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError):  # a string, None, a ragged list: not a target
        shown = repr(y) if len(repr(y)) <= 40 else repr(y)[:37] + "..."
        raise ConfigError(
            f"{where}: y must be a target the loss can take: a tensor (class labels, regression values, ...), "
            f"a number, or a tuple, list or dict of tensors; got {type(y).__name__} {shown}"
        ) from None


def check_sample(sample: object, where: str = "data set") -> tuple[Any, Any]:
    """Return ``(x, y)`` of one sample, ``y`` as the loss gets it (:func:`_target`), or explain what
    a sample must look like.

    ``x`` is a tensor, or tuples, lists and dicts of tensors nested in any way (``(src, tgt_in)``,
    ``{"input_ids": ..., "attention_mask": ...}``); so is ``y``, whose dtype and values are never
    changed: class labels, regression targets and structured targets reach the loss as given."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ConfigError(
            f"{where}: a sample must be a pair (x, y) of inputs (a tensor, or a tuple, list or dict of tensors) "
            f"and a target, got {type(sample).__name__}"
            + (f" of length {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        )
    x, y = sample
    if not isinstance(x, torch.Tensor):
        leaves, _ = flatten(x) if isinstance(x, (tuple, list, dict)) else ((x,), None)
        wrong = [(path, leaf) for path, leaf in zip(leaf_paths(x), leaves) if not isinstance(leaf, torch.Tensor)]
        if wrong or not leaves:
            detail = f"x{wrong[0][0]} is a {type(wrong[0][1]).__name__}" if wrong else f"x is an empty {type(x).__name__}"
            raise ConfigError(
                f"{where}: x must be a torch.Tensor, or a tuple, list or dict of tensors (nested in any way); "
                f"{detail}"
            )
    return x, _target(y, where)


def class_labels(y: Any) -> bool:
    """Whether targets ``y`` are class labels: one tensor of an integer dtype (not bool)."""
    return (isinstance(y, torch.Tensor) and not y.dtype.is_floating_point and not y.dtype.is_complex
            and y.dtype != torch.bool)


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


def stack_samples(samples: Sequence[Any], where: str = "data set") -> tuple[Any, Any]:
    """``(x, y)`` pairs stacked along a new batch dimension, a structured ``x`` or ``y`` tensor by
    tensor; targets keep the dtype the samples give (numbers as :func:`check_sample` reads them).

    The common case costs one ``torch.stack`` per field; only a batch that fails is checked sample
    by sample, so that the error names what is wrong.
    """
    try:
        xs, ys = zip(*samples)
        x = torch.stack(xs) if isinstance(xs[0], torch.Tensor) else None
        y = torch.stack(ys) if isinstance(ys[0], torch.Tensor) else None if _structured(ys[0]) else torch.tensor(ys)
    except (TypeError, ValueError, RuntimeError) as error:
        for sample in samples:
            check_sample(sample, where)
        shapes = sorted({(tuple(s[0].shape) if isinstance(s[0], torch.Tensor) else describe(s[0]),
                          describe(_target(s[1], where))) for s in samples},
                        key=lambda pair: (isinstance(pair[0], str), pair))
        raise ConfigError(
            f"{where}: the samples of a batch cannot be stacked ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); every x must have one shape and every y "
            f"another, got (x, y) shapes {shapes[:4]}"
        ) from None
    if x is None or y is None:  # a structured x or y: stacked leaf by leaf, an error names the leaf
        check_sample(samples[0], where)
        try:
            x = stack(xs) if x is None else x
            y = stack([_target(v, where) for v in ys], "y") if y is None else y
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    return x, y


def _base_indices(dataset: Dataset, indices: Sequence[int] | torch.Tensor) -> tuple[Dataset, list[int] | torch.Tensor]:
    """``(base, index)``: the data set below any ``Subset`` wrappers and the indices into it, in
    O(len(indices)) whatever the length of the subsets' index lists."""
    index: list[int] | torch.Tensor = indices if isinstance(indices, torch.Tensor) else list(indices)
    while isinstance(dataset, Subset):
        inner = dataset.indices
        if isinstance(inner, torch.Tensor):
            index = inner[torch.as_tensor(index, dtype=torch.int64)]
        elif isinstance(inner, np.ndarray):
            index = torch.from_numpy(np.asarray(inner[np.asarray(index, dtype=np.int64)], dtype=np.int64))
        else:
            positions = index.tolist() if isinstance(index, torch.Tensor) else index
            index = [int(inner[i]) for i in positions]
        dataset = dataset.dataset
    return dataset, index


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


def get_batch(dataset: Dataset, indices: Sequence[int] | torch.Tensor) -> tuple[Any, Any]:
    """Stack the samples ``indices`` of ``dataset`` into ``(x, y)`` with a leading batch dimension.

    A data set with a ``batch(indices) -> (x, y)`` method builds the batch itself (``text``: it
    gathers the windows and, with ``min_length``, cuts the batch to a length drawn from the
    indices; build each update's whole batch with one call, then split it into microbatches). A
    data set of two tensors (built-ins, TensorDataset) is indexed in one operation; any other is
    read sample by sample (:func:`stack_samples`). ``Subset`` wrappers cost O(len(indices)).
    Targets come back with the dtype and structure the data set gives them.
    """
    dataset, index = _base_indices(dataset, indices)
    batch = getattr(dataset, "batch", None)
    if callable(batch):
        return _read_batch(dataset, torch.as_tensor(index, dtype=torch.int64))
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:
        index = torch.as_tensor(index, dtype=torch.int64)
        return tensors[0][index], tensors[1][index]
    positions = index.tolist() if isinstance(index, torch.Tensor) else index
    return stack_samples([read_sample(dataset, i) for i in positions])


def _declared_classes(dataset: Dataset) -> int | None:
    while True:
        count = getattr(dataset, "num_classes", None)
        if count is not None or not isinstance(dataset, Subset):
            return count
        dataset = dataset.dataset


def _stored_labels(dataset: Dataset) -> torch.Tensor | None:
    """The labels of ``dataset`` without reading a sample: its ``targets`` (torchvision's name) or
    its second tensor, through any ``Subset`` wrappers; None when it has neither."""
    base, index = _base_indices(dataset, torch.arange(len(dataset)))  # type: ignore[arg-type]
    targets = getattr(base, "targets", None)
    if targets is None:
        tensors = getattr(base, "tensors", None)
        if not (isinstance(tensors, tuple) and len(tensors) == 2):
            return None
        targets = tensors[1]
    labels = torch.as_tensor(targets) if not isinstance(targets, torch.Tensor) else targets
    return labels if base is dataset else labels[torch.as_tensor(index, dtype=torch.int64)]


def dataset_info(dataset: Dataset, first: object = None) -> DataInfo:
    """Input shape of one sample and the class count of ``dataset``.

    ``first``: ``dataset[0]`` when the caller has read it already (it is not read again). The
    class count is ``dataset.num_classes`` when the data set (or the one under a ``Subset``) has
    it, as built-ins do; else one more than the largest label, taken from ``dataset.targets`` or
    a second tensor when present, else by reading every other sample once (give the data set a
    ``num_classes`` attribute to skip that pass). The pass runs under a fixed seed and leaves the
    caller's random generators as they were. Labels of -100 are ignored targets (padding, unmasked
    tokens), not classes. Targets that are not class labels (:func:`class_labels`) have no class
    count: ``num_classes`` is then None.
    """
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise ConfigError("data set has no len(): pipetrain needs a map-style Dataset") from error
    if n == 0:
        raise ConfigError("data set is empty")
    x, y0 = check_sample(read_sample(dataset, 0) if first is None else first)
    x = first_tensor(x)
    num_classes = _declared_classes(dataset)
    if num_classes is None and class_labels(y0):
        labels = _stored_labels(dataset)
        if labels is None:
            parts = [y0.reshape(-1)]
            try:
                with seeded(0):
                    for start in range(1, n, 256):
                        parts.append(get_batch(dataset, range(start, min(start + 256, n)))[1].reshape(-1))
            except ConfigError as error:
                raise ConfigError(
                    f"counting the classes of the data set (give it a num_classes attribute to skip this): {error}"
                ) from None
            labels = torch.cat(parts)
        num_classes = _class_count(labels) if class_labels(labels) else None
    return DataInfo(tuple(int(s) for s in x.shape), None if num_classes is None else int(num_classes))
