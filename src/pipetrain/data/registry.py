"""`--data` specs to data sets: built-ins (`digits`, `synthetic`, `text`) and `PKG.MOD:FACTORY`."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset, Subset

from pipetrain.data.digits import load_digits
from pipetrain.data.info import check_sample, read_sample
from pipetrain.data.synthetic import load_synthetic
from pipetrain.data.text import load_text
from pipetrain.errors import ConfigError
from pipetrain.spec import Spec, call_factory, parse_spec, resolve_factory

__all__ = ["DATASETS", "DEFAULT_TEST_FRACTION", "load_dataset", "load_train_test", "split_indices"]

#: built-in data set name -> factory taking the spec's options (all accept ``split``).
DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "text": load_text,
}

#: share of a user data set held out by :func:`load_train_test` when its factory has no ``split``.
DEFAULT_TEST_FRACTION = 0.2


def _spec(spec: str | Spec) -> Spec:
    return spec if isinstance(spec, Spec) else parse_spec(spec, builtins=DATASETS, kind="data set")


def _validate(dataset: Any, spec: Spec) -> Dataset:
    where = f"data spec {spec.text!r}"
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(
            f"{where}: the factory returned a {type(dataset).__name__}, not a map-style "
            f"torch.utils.data.Dataset (needs __len__ and __getitem__) of (x, y) pairs"
        )
    if len(dataset) == 0:
        raise ConfigError(f"{where}: the data set is empty")
    check_sample(read_sample(dataset, 0), where)
    return dataset


def load_dataset(spec: str | Spec, **overrides: Any) -> Dataset:
    """The data set named by ``spec`` (options in ``overrides`` win over those in the spec).

    ``digits`` is the 1437-sample train split (``digits:split=test`` the 360-sample test split,
    ``digits:split=all`` all 1797); ``synthetic:features=N,classes=C,samples=K,seed=S``;
    ``text:source=stdlib,block_size=64[,min_length=L]`` (next-character pairs); or
    ``PKG.MOD:FACTORY[:k=v,...]`` returning a Dataset of ``(x, y)`` pairs.
    """
    spec = _spec(spec)
    kwargs = {**spec.kwargs, **overrides}
    if spec.is_builtin:
        factory = DATASETS[spec.name]  # type: ignore[index]
        return call_factory(factory, kwargs, what=f"data set {spec.name!r}")
    factory = resolve_factory(spec, kind="data")
    return _validate(call_factory(factory, kwargs, what=f"data factory {spec.label}"), spec)


def split_indices(n: int, test_fraction: float = DEFAULT_TEST_FRACTION) -> tuple[list[int], list[int]]:
    """Fixed ``(train, test)`` index lists of ``n`` samples: ``RandomState(0).permutation(n)``,
    the first ``round(n * test_fraction)`` (at least one) to test; both ascending."""
    if n < 2:
        raise ConfigError(f"cannot split {n} sample(s) into train and test")
    n_test = min(n - 1, max(1, round(n * test_fraction)))
    permutation = np.random.RandomState(0).permutation(n)
    return sorted(permutation[n_test:].tolist()), sorted(permutation[:n_test].tolist())


def _accepts_split(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "split" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def load_train_test(spec: str | Spec, **overrides: Any) -> tuple[Dataset, Dataset]:
    """``(train, test)`` data sets of ``spec``.

    Built-ins and factories with a ``split`` parameter are called with ``split="train"`` and
    ``split="test"``. Any other factory's data set is cut by :func:`split_indices` (a fixed 20 %
    held out). A ``split`` option in the spec is an error here.
    """
    spec = _spec(spec)
    if "split" in spec.kwargs or "split" in overrides:
        raise ConfigError(
            f"data spec {spec.text!r}: drop the split= option; train and test splits are both returned"
        )
    if spec.is_builtin or _accepts_split(resolve_factory(spec, kind="data")):
        return load_dataset(spec, **overrides, split="train"), load_dataset(spec, **overrides, split="test")
    full = load_dataset(spec, **overrides)
    train, test = split_indices(len(full))
    return Subset(full, train), Subset(full, test)


