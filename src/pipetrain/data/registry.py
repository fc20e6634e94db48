"""`--data` specs to data sets: built-ins (`digits`, `synthetic`, `text`) and `PKG.MOD:FACTORY`,
and where a run's held-out data comes from (never a silent hold-out)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, Dataset, Subset

from pipetrain.data.digits import load_digits
from pipetrain.data.info import DataInfo, check_sample, dataset_info, read_sample
from pipetrain.data.loader import loader_info
from pipetrain.data.synthetic import load_synthetic
from pipetrain.data.text import load_text
from pipetrain.errors import ConfigError, option
from pipetrain.spec import Spec, call_factory, parse_spec, resolve_factory

__all__ = ["DATASETS", "RunData", "load_data", "load_dataset", "load_train_test", "split_indices"]

#: built-in data set name -> factory taking the spec's options (all accept ``split``).
DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "text": load_text,
}


def _spec(spec: str | Spec) -> Spec:
    return spec if isinstance(spec, Spec) else parse_spec(spec, builtins=DATASETS, kind="data set")


def _validate(dataset: Any, spec: Spec) -> tuple[Dataset, object]:
    """``(dataset, dataset[0])``: the one sample read to check the factory's data set."""
    where = f"data spec {spec.text!r}"
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(
            f"{where}: the factory returned a {type(dataset).__name__}, not a map-style "
            f"torch.utils.data.Dataset (needs __len__ and __getitem__) of (x, y) pairs"
        )
    if len(dataset) == 0:
        raise ConfigError(f"{where}: the data set is empty")
    first = read_sample(dataset, 0)
    check_sample(first, where)
    return dataset, first


def _load(spec: Spec, overrides: dict[str, Any]) -> tuple[Dataset, object]:
    """The data set of ``spec`` and its first sample when checking it read one (else None)."""
    kwargs = {**spec.kwargs, **overrides}
    if spec.is_builtin:
        factory = DATASETS[spec.name]  # type: ignore[index]
        return call_factory(factory, kwargs, what=f"data set {spec.name!r}"), None
    factory = resolve_factory(spec, kind="data")
    made = call_factory(factory, kwargs, what=f"data factory {spec.label}")
    if isinstance(made, DataLoader):
        return made, None  # read as it is (pipetrain.data.loader)
    return _validate(made, spec)


def load_dataset(spec: str | Spec, **overrides: Any) -> Dataset:
    """The data set named by ``spec`` (options in ``overrides`` win over those in the spec).

    ``digits`` is the 1437-sample train split (``digits:split=test`` the 360-sample test split,
    ``digits:split=all`` all 1797); ``synthetic:features=N,classes=C,samples=K,seed=S``;
    ``text:source=stdlib,block_size=64[,min_length=L]`` (next-character pairs); or
    ``PKG.MOD:FACTORY[:k=v,...]`` returning a Dataset of ``(x, y)`` pairs (or a DataLoader of
    ``(x, y)`` batches).
    """
    return _load(_spec(spec), dict(overrides))[0]


def split_indices(n: int, test_fraction: float) -> tuple[list[int], list[int]]:
    """Fixed ``(train, test)`` index lists of ``n`` samples: ``RandomState(0).permutation(n)``,
    the first ``round(n * test_fraction)`` (at least one) to test; both ascending."""
    if n < 2:
        raise ConfigError(f"cannot split {n} sample(s) into train and held-out samples")
    n_test = min(n - 1, max(1, round(n * test_fraction)))
    permutation = np.random.RandomState(0).permutation(n)
    return sorted(permutation[n_test:].tolist()), sorted(permutation[:n_test].tolist())


def _accepts_split(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "split" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _check_holdout(holdout: float | None) -> None:
    if holdout is not None and not (isinstance(holdout, (int, float)) and 0 < holdout < 1):
        raise ConfigError(f"{option('holdout')} must be a fraction between 0 and 1 (e.g. 0.2), got {holdout!r}")


def _has_split(spec: Spec) -> bool:
    return spec.is_builtin or _accepts_split(resolve_factory(spec, kind="data"))


def _refuse_split_option(spec: Spec, overrides: dict[str, Any]) -> None:
    if "split" in spec.kwargs or "split" in overrides:
        raise ConfigError(
            f"data spec {spec.text!r}: drop the split= option; the train split is read, and the test "
            f"split when the run needs held-out data"
        )


def load_train_test(
    spec: str | Spec, holdout: float | None = None, **overrides: Any
) -> tuple[Dataset, Dataset | None]:
    """``(train, test)`` data sets of ``spec``; ``test`` is None when there is none.

    With ``holdout``, that fraction of the (train split of the) data set is held out by
    :func:`split_indices` and both come back as ``Subset`` s of it. Else built-ins and factories
    with a ``split`` parameter are called with ``split="train"`` and ``split="test"``, and any
    other factory's whole data set is the train set, with no test set. A ``split`` option in the
    spec is an error here.
    """
    data = load_data(spec, holdout=holdout, **overrides)
    return data.train, data.test


def _held_out(test: Dataset) -> Dataset:
    """A held-out data set; a DataLoader's is evaluated through its (map-style) data set."""
    if isinstance(test, DataLoader):
        test = test.dataset
        if not hasattr(test, "__getitem__") or not hasattr(test, "__len__"):
            raise ConfigError("the held-out DataLoader reads an IterableDataset; evaluation needs a map-style Dataset")
    return test


class RunData(NamedTuple):
    """A run's data: ``train``, the held-out ``test`` set (or None), ``info`` (what the model
    needs to know of ``train``) and ``note``, which says where the held-out data came from
    (``"held out: the test split of digits (360 samples)"``)."""

    train: Dataset
    test: Dataset | None
    info: DataInfo
    note: str


def load_data(
    spec: str | Spec, test_data: str | Spec | None = None, holdout: float | None = None, **overrides: Any
) -> RunData:
    """The data of a run (``--data``, ``--test-data``, ``--holdout``), each sample read once.

    The held-out data is, in this order: ``test_data``; a ``holdout`` fraction of the training
    data (``split=train`` when the factory has splits), cut by :func:`split_indices`; the data
    set's own test split (built-ins, factories with a ``split`` parameter); or none at all (no
    evaluation). Nothing is held out unless asked for.

    A factory may return a ``DataLoader``: it is the training data as it is (read by
    :class:`~pipetrain.data.LoaderBatches`), and a held-out DataLoader is evaluated through its
    data set.
    """
    spec = _spec(spec)
    overrides = dict(overrides)
    _refuse_split_option(spec, overrides)
    _check_holdout(holdout)
    if test_data is not None and holdout is not None:
        raise ConfigError(f"give either {option('test_data')} or {option('holdout')}, not both")
    own_split = _has_split(spec)
    train, first = _load(spec, {**overrides, "split": "train"} if own_split else overrides)
    if test_data is not None:
        test_spec = _spec(test_data)
        test = _held_out(_load(test_spec, {})[0])
        note = f"held out: --test-data {test_spec.text} ({len(test)} samples)"  # type: ignore[arg-type]
    elif holdout is not None:
        if isinstance(train, DataLoader):
            raise ConfigError(
                f"{option('holdout')} cuts a Dataset, but {spec.label} returns a DataLoader: give the factory a "
                f"split= parameter or use {option('test_data')}"
            )
        kept, held = split_indices(len(train), holdout)  # type: ignore[arg-type]
        first = first if kept[0] == 0 else None
        full, train, test = train, Subset(train, kept), Subset(train, held)
        note = f"held out: --holdout {holdout:g}, {len(held)} of the {len(full)} samples (a fixed split)"  # type: ignore[arg-type]
    elif own_split:
        test = _held_out(_load(spec, {**overrides, "split": "test"})[0])
        note = f"held out: the test split of {spec.text} ({len(test)} samples)"  # type: ignore[arg-type]
    else:
        test = None
        note = (
            f"held out: nothing ({spec.label} has no split= parameter), so no evaluation; "
            f"give --test-data SPEC or --holdout FRACTION to evaluate"
        )
    if isinstance(train, DataLoader):
        return RunData(train, test, loader_info(train, f"data spec {spec.text!r}"), note)
    return RunData(train, test, dataset_info(train, first), note)
