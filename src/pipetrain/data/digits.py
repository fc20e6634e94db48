"""The `digits` data set: scikit-learn's 8x8 handwritten digits with a fixed train/test split.

1797 images of 8x8 pixels with values 0..16 (shipped inside scikit-learn, no network), scaled to
[0, 1] by x/16 as float32 rows of 64 features; labels 0..9 as int64.

Split (fixed, independent of any seed): ``p = numpy.random.RandomState(0).permutation(1797)``;
test = ``sorted(p[:360])`` (360 samples), train = ``sorted(p[360:])`` (1437 samples). Samples keep
their original relative order inside each split. Test class counts: 27 35 36 29 30 40 44 39 39 41.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pipetrain.data.tensors import ClassificationTensors
from pipetrain.errors import ConfigError

__all__ = ["DIGITS_TEST_SIZE", "digits_split_indices", "load_digits"]

DIGITS_TEST_SIZE = 360
_SPLITS = ("train", "test", "all")


@functools.lru_cache(maxsize=1)
def _arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sklearn_digits  # scikit-learn is slow to import: when first read

    bunch = sklearn_digits()
    features = (bunch.data / 16.0).astype(np.float32)
    labels = bunch.target.astype(np.int64)
    return features, labels


def digits_split_indices(split: str) -> np.ndarray:
    """Row indices into scikit-learn's digits of ``split`` ("train", "test" or "all"), ascending."""
    n = _arrays()[0].shape[0]
    if split == "all":
        return np.arange(n)
    permutation = np.random.RandomState(0).permutation(n)
    if split == "test":
        return np.sort(permutation[:DIGITS_TEST_SIZE])
    if split == "train":
        return np.sort(permutation[DIGITS_TEST_SIZE:])
    raise ConfigError(f"digits: unknown split {split!r}; use one of {', '.join(_SPLITS)}")


def load_digits(split: str = "train") -> ClassificationTensors:
    """The digits ``split``: float32 features (N, 64) in [0, 1] and int64 labels (N,)."""
    index = digits_split_indices(split)
    features, labels = _arrays()
    return ClassificationTensors(
        torch.from_numpy(features[index].copy()),
        torch.from_numpy(labels[index].copy()),
        num_classes=10,
        name=f"digits:{split}",
    )
