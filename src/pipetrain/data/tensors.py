"""In-memory classification data sets: features and labels as two tensors."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["ClassificationTensors"]


class ClassificationTensors(TensorDataset):
    """A :class:`~torch.utils.data.TensorDataset` of ``(x, y)`` that knows its class count.

    Built-in data sets are small enough to live in memory; keeping them as two tensors lets a
    batch be gathered with one indexing operation (see :func:`pipetrain.data.get_batch`) instead
    of stacking samples one by one. ``num_classes`` is stored because a split may lack a class.
    """

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, num_classes: int, name: str = ""):
        if features.shape[0] != labels.shape[0]:
            raise ValueError(f"{features.shape[0]} feature rows but {labels.shape[0]} labels")
        super().__init__(features, labels)
        self.num_classes = int(num_classes)
        self.name = name

    @property
    def features(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def labels(self) -> torch.Tensor:
        return self.tensors[1]

    def __repr__(self) -> str:
        shape = tuple(self.features.shape[1:])
        return (
            f"ClassificationTensors({self.name or 'data'}: {len(self)} samples, "
            f"input {shape}, {self.num_classes} classes)"
        )
