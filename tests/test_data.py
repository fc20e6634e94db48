"""Tests of pipetrain.data: digits, synthetic, user factories, data info and batches."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from pipetrain.data import (
    DIGITS_TEST_SIZE,
    DataInfo,
    dataset_info,
    get_batch,
    load_dataset,
    load_digits,
    load_data,
    load_train_test,
    split_indices,
)
from pipetrain.data.digits import digits_split_indices
from pipetrain.errors import ConfigError
import pipetrain.training.config  # noqa: F401,E402 - declares the keywords messages name (eval_data for test_data)

_counter = itertools.count()


def write_module(tmp_path, monkeypatch, source: str) -> str:
    name = f"pt_data_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


def test_digits_splits():
    train, test, full = load_digits("train"), load_dataset("digits:split=test"), load_dataset("digits:split=all")
    assert (len(train), len(test), len(full)) == (1437, DIGITS_TEST_SIZE, 1797)
    assert len(load_dataset("digits")) == 1437
    for data in (train, test):
        assert data.features.dtype == torch.float32 and data.features.shape[1] == 64
        assert data.labels.dtype == torch.int64
        assert float(data.features.min()) == 0.0 and float(data.features.max()) == 1.0
        assert data.num_classes == 10
    train_index, test_index = digits_split_indices("train"), digits_split_indices("test")
    assert not set(train_index) & set(test_index)
    assert sorted([*train_index, *test_index]) == list(range(1797))
    assert torch.equal(full.features[torch.from_numpy(test_index)], test.features)
    assert torch.equal(full.labels[torch.from_numpy(train_index)], train.labels)


def test_digits_split_is_the_documented_one():
    expected = np.sort(np.random.RandomState(0).permutation(1797)[:360])
    assert np.array_equal(digits_split_indices("test"), expected)
    assert np.bincount(load_digits("test").labels.numpy()).tolist() == [27, 35, 36, 29, 30, 40, 44, 39, 39, 41]
    from sklearn.datasets import load_digits as sk

    raw = sk()
    assert torch.equal(load_digits("all").features, torch.from_numpy((raw.data / 16).astype(np.float32)))


def test_digits_bad_split():
    with pytest.raises(ConfigError, match="train, test, all"):
        load_dataset("digits:split=valid")


def test_train_test_digits():
    train, test = load_train_test("digits")
    assert (len(train), len(test)) == (1437, 360)
    with pytest.raises(ConfigError, match="drop the split"):
        load_train_test("digits:split=test")


def test_synthetic_shapes_and_determinism():
    a = load_dataset("synthetic:features=7,classes=3,samples=30,seed=4")
    b = load_dataset("synthetic:features=7,classes=3,samples=30,seed=4")
    c = load_dataset("synthetic:features=7,classes=3,samples=30,seed=5")
    assert a.features.shape == (30, 7) and a.features.dtype == torch.float32
    assert a.labels.dtype == torch.int64 and np.bincount(a.labels.numpy()).tolist() == [10, 10, 10]
    assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.features, c.features)
    assert dataset_info(a) == DataInfo((7,), 3)


def test_synthetic_is_learnable_and_test_split_shares_centres():
    train, test = load_train_test("synthetic:features=16,classes=5,samples=500")
    assert not torch.equal(train.features, test.features)
    centres = torch.stack([train.features[train.labels == c].mean(0) for c in range(5)])
    predicted = torch.cdist(test.features, centres).argmin(1)
    assert (predicted == test.labels).float().mean() > 0.9


@pytest.mark.parametrize(
    "spec, word",
    [
        ("synthetic:features=0", "features"),
        ("synthetic:classes=1", "classes"),
        ("synthetic:samples=2.5", "samples"),
        ("synthetic:seed=-1", "seed"),
        ("synthetic:split=dev", "split"),
        ("synthetic:featurs=3", "featurs"),
    ],
)
def test_synthetic_errors(spec, word):
    with pytest.raises(ConfigError, match=word):
        load_dataset(spec)


def test_unknown_data_set_suggests():
    with pytest.raises(ConfigError, match="Did you mean 'digits'"):
        load_dataset("digit")


FACTORY = """
import torch
from torch.utils.data import Dataset, TensorDataset

def make(samples=10, features=3):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, features, generator=g), torch.arange(samples) % 4)

def with_split(split="train", samples=8):
    n = samples if split == "train" else 2
    return TensorDataset(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))

class Pairs(Dataset):
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return torch.full((2, 3), float(i)), i % 3

def pairs():
    return Pairs()

def not_a_dataset():
    return 42

def triples():
    return [(torch.zeros(2), 1, 2)]

def named_labels():
    return [(torch.zeros(2), "cat")]
"""


def test_user_factory(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    data = load_dataset(f"{name}:make:samples=12")
    assert len(data) == 12 and dataset_info(data) == DataInfo((3,), 4)
    pairs = load_dataset(f"{name}:pairs")
    assert dataset_info(pairs) == DataInfo((2, 3), 3)
    x, y = get_batch(pairs, [4, 1])
    assert x.shape == (2, 2, 3) and float(x[0, 0, 0]) == 4.0 and y.tolist() == [1, 1]


def test_user_factory_train_test(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    train, test = load_train_test(f"{name}:with_split:samples=5")
    assert (len(train), len(test)) == (5, 2)
    train, test = load_train_test(f"{name}:make:samples=10")  # no split=: nothing is held out
    assert len(train) == 10 and test is None
    train, test = load_train_test(f"{name}:make:samples=10", holdout=0.2)
    assert isinstance(train, Subset) and (len(train), len(test)) == (8, 2)
    assert sorted([*train.indices, *test.indices]) == list(range(10))


def test_where_held_out_data_comes_from_is_said(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    own = load_data("digits")
    assert len(own.test) == 360 and own.note == "held out: the test split of digits (360 samples)"
    none = load_data(f"{name}:make:samples=10")
    assert none.test is None and "nothing" in none.note and "--holdout FRACTION" in none.note
    cut = load_data(f"{name}:make:samples=10", holdout=0.3)
    assert (len(cut.train), len(cut.test)) == (7, 3) and cut.note == "held out: --holdout 0.3, 3 of the 10 samples (a fixed split)"
    split = load_data("digits", holdout=0.5)  # a data set with splits: its train split is cut
    assert (len(split.train), len(split.test)) == (719, 718) and split.info == DataInfo((64,), 10)
    other = load_data(f"{name}:make:samples=10", test_data="digits:split=test")
    assert len(other.test) == 360 and other.note == "held out: --test-data digits:split=test (360 samples)"
    with pytest.raises(ConfigError, match="either eval_data or holdout"):
        load_data("digits", test_data="digits", holdout=0.2)
    for bad in (0, 1, 1.5, -0.1, "x"):
        with pytest.raises(ConfigError, match="holdout must be a fraction"):
            load_data("digits", holdout=bad)


COUNTING = """
import torch
from torch.utils.data import Dataset

READS = []

class Counting(Dataset):
    def __init__(self, n, declared):
        self.n = n
        if declared:
            self.num_classes = 5
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        READS.append(i)
        return torch.full((3,), float(i)), i % 4

def make(samples=20, declared=False):
    return Counting(samples, declared)
"""


def test_set_up_reads_no_sample_more_than_once(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, COUNTING)
    data = load_data(f"{name}:make")  # the class count comes from reading every sample once
    reads = sys.modules[name].READS
    assert data.info == DataInfo((3,), 4) and sorted(reads) == list(range(20))
    reads.clear()
    data = load_data(f"{name}:make:declared=true")  # declared: only the sample that checks the factory
    assert data.info == DataInfo((3,), 5) and reads == [0]
    reads.clear()
    load_data(f"{name}:make", holdout=0.25)
    assert len(reads) == len(set(reads)) == 15  # the checked sample and the training samples, once each


@pytest.mark.parametrize(
    "factory, word",
    [("not_a_dataset", "not a map-style"), ("triples", "pair"), ("named_labels", "y must be a target")],
)
def test_user_factory_errors(tmp_path, monkeypatch, factory, word):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    with pytest.raises(ConfigError, match=word):
        load_dataset(f"{name}:{factory}")


def test_user_factory_unknown_option(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, FACTORY)
    with pytest.raises(ConfigError, match="accepted: samples, features"):
        load_dataset(f"{name}:make:size=3")


def test_split_indices():
    train, test = split_indices(10, 0.2)
    assert len(test) == 2 and sorted(train + test) == list(range(10))
    assert split_indices(10, 0.2) == (train, test)
    assert len(split_indices(2, 0.2)[1]) == 1
    with pytest.raises(ConfigError):
        split_indices(1, 0.2)


def test_dataset_info_scans_labels_and_subsets():
    data = TensorDataset(torch.zeros(5, 2, 2), torch.tensor([0, 3, 1, 1, 2]))
    assert dataset_info(data) == DataInfo((2, 2), 4)
    assert dataset_info(data).in_features == 4
    digits = load_digits("test")
    assert dataset_info(Subset(digits, [0, 1])) == DataInfo((64,), 10)

    class Targets(Dataset):
        targets = [0, 6]

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(1), self.targets[i]

    assert dataset_info(Targets()).num_classes == 7


def test_dataset_info_rejects_empty_and_negative():
    with pytest.raises(ConfigError, match="empty"):
        dataset_info(TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)))
    with pytest.raises(ConfigError, match="negative"):
        dataset_info(TensorDataset(torch.zeros(2, 2), torch.tensor([0, -1])))


def test_get_batch_tensor_and_subset():
    digits = load_digits("train")
    x, y = get_batch(digits, torch.tensor([5, 0, 5]))
    assert torch.equal(x, digits.features[[5, 0, 5]]) and torch.equal(y, digits.labels[[5, 0, 5]])
    sub = Subset(Subset(digits, list(range(100, 200))), [3, 1])
    x, y = get_batch(sub, [0, 1])
    assert torch.equal(x, digits.features[[103, 101]])
    for inner in (torch.arange(100, 200), np.arange(100, 200), range(100, 200)):
        x, y = get_batch(Subset(Subset(digits, inner), [3, 1]), torch.tensor([0, 1]))
        assert torch.equal(x, digits.features[[103, 101]]) and torch.equal(y, digits.labels[[103, 101]])


class _Indices(list):
    """A Subset's index list that counts the entries read and refuses to be read whole."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = 0

    def __getitem__(self, i):
        self.read += 1
        return super().__getitem__(i)

    def __iter__(self):
        raise AssertionError("the whole index list was read")


def test_a_subset_read_costs_its_batch_not_its_length():
    pairs = [(torch.full((2,), float(i)), i % 3) for i in range(1000)]
    for base in (TensorDataset(torch.arange(1000.0)[:, None], torch.arange(1000) % 3), pairs):
        indices = _Indices(range(999, -1, -1))
        x, y = get_batch(Subset(base, indices), [0, 5, 7])
        assert indices.read == 3 and x[:, 0].tolist() == [999.0, 994.0, 992.0] and y.tolist() == [0, 1, 2]


def test_stacking_errors_name_what_is_wrong():
    with pytest.raises(ConfigError, match="cannot be stacked.*shapes"):
        get_batch([(torch.zeros(2), 0), (torch.zeros(3), 1)], [0, 1])
    with pytest.raises(ConfigError, match="y must be a target"):
        get_batch([(torch.zeros(2), "cat"), (torch.zeros(2), "dog")], [0, 1])
    _, floats = get_batch([(torch.zeros(2), 0.5), (torch.zeros(2), 1.5)], [0, 1])  # regression targets as given
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 1.5]
    with pytest.raises(ConfigError, match="pair"):
        get_batch([(torch.zeros(2), 0, 1)], [0])
    x, y = get_batch([(torch.zeros(2), torch.tensor(1)), (torch.ones(2), torch.tensor(2))], [1, 0])
    assert x.tolist() == [[1.0, 1.0], [0.0, 0.0]] and y.dtype == torch.int64 and y.tolist() == [2, 1]


def test_train_command_says_where_the_held_out_data_comes_from(tmp_path, monkeypatch, capsys):
    from pipetrain.cli import main

    name = write_module(tmp_path, monkeypatch, FACTORY)
    small = ["train", "--executor", "emulate", "--model", "mlp:depth=2,width=8", "--batch-size", "4", "--steps", "2",
             "--stages", "2", "--no-progress"]
    assert main([*small, "--data", f"{name}:make:samples=20", "--holdout", "0.25", "--data-workers", "0"]) == 0
    out = capsys.readouterr().out
    assert ("data: 15 samples, read by index, ahead on a background thread; held out: --holdout 0.25, 5 "
            "of the 20 samples (a fixed split)") in out.splitlines() and "test accuracy" in out
    assert main([*small, "--data", f"{name}:pairs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"data: 6 samples, read sample by sample in 1 DataLoader worker process; held out: nothing "
                      f"({name}:pairs has no split= parameter), so no evaluation; give --test-data SPEC or --holdout "
                      "FRACTION to evaluate")
    assert "test accuracy" not in out[-1]
    assert main([*small, "--data", "digits", "--data-workers", "-1"]) == 2
    assert "--data-workers must be an integer >= 0" in capsys.readouterr().err
    assert main([*small, "--data", "digits", "--holdout", "2"]) == 2
    assert "--holdout must be a fraction" in capsys.readouterr().err


def test_train_help_states_the_data_defaults(capsys):
    from pipetrain.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--holdout FRACTION" in text and "(default: none;" in text
    assert "--data-workers N" in text and "(default 1;" in text and "--pin-memory" in text


BROKEN = """
import torch
from torch.utils.data import Dataset

class Broken(Dataset):
    def __init__(self, bad):
        self.bad = bad
    def __len__(self):
        return 10
    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"sample {i} is missing")
        return torch.zeros(2), i % 2

def make(bad=0):
    return Broken(bad)
"""


def test_a_failing_getitem_during_set_up_is_one_line(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, BROKEN)
    with pytest.raises(ConfigError) as caught:
        load_data(f"{name}:make:bad=0")
    assert str(caught.value).startswith("data set Broken: reading sample 0 raised KeyError: 'sample 0 is missing' (")
    with pytest.raises(ConfigError) as caught:
        load_data(f"{name}:make:bad=7")
    assert str(caught.value).startswith("counting the classes of the data set (give it a num_classes attribute to skip "
                                        "this): data set Broken: reading sample 7 raised KeyError: 'sample 7 is missing'")


# -- structured samples: x a tuple, list or dict of tensors --------------------------------------

from torch.utils.data import DataLoader  # noqa: E402

from pipetrain.data import DatasetBatches, LoaderBatches  # noqa: E402
from pipetrain.execution import UnitData, UnitLayout  # noqa: E402


class Pairs(Dataset):
    """x = {"ids": int64 (5,), "mask": bool (5,), "pair": (float64 (2,), int64 ())}, y an int."""

    num_classes = 3

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        ids = torch.arange(5) + i
        x = {"ids": ids, "mask": ids % 2 == 0, "pair": (torch.full((2,), float(i), dtype=torch.float64), ids[0])}
        return x, i % 3


def test_structured_samples_stack_into_a_structured_batch():
    x, y = get_batch(Pairs(), [1, 4, 7])
    assert list(x) == ["ids", "mask", "pair"] and isinstance(x["pair"], tuple)
    assert x["ids"].shape == (3, 5) and x["mask"].dtype == torch.bool and x["pair"][1].tolist() == [1, 4, 7]
    assert torch.equal(x["pair"][0][:, 0], torch.tensor([1.0, 4.0, 7.0], dtype=torch.float64))
    assert y.tolist() == [1, 1, 1] and y.dtype == torch.int64
    assert dataset_info(Pairs()) == DataInfo((5,), 3)  # input_shape: the first tensor's (ids)


def test_a_structured_batch_is_cut_into_microbatches_and_cast_leaf_by_leaf():
    batches = DatasetBatches(Pairs(), lambda t: torch.arange(8), workers=0, dtype=torch.float32)
    units = UnitData.of(batches, UnitLayout(8, 3))
    x, y = units.unit(1)  # samples 3:6 of update 0
    assert x["ids"][:, 0].tolist() == [3, 4, 5] and y.tolist() == [0, 1, 2]
    assert x["pair"][0].dtype == torch.float32 and x["ids"].dtype == torch.int64 and x["mask"].dtype == torch.bool


class Broken(Dataset):
    def __init__(self, sample):
        self.sample = sample

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return self.sample(i)


def test_structured_samples_that_do_not_fit_are_named_by_path():
    with pytest.raises(ConfigError, match=r"x\['mask'\] is a str"):
        dataset_info(Broken(lambda i: ({"ids": torch.arange(3), "mask": "no"}, 0)))
    with pytest.raises(ConfigError, match=r"x is an empty tuple"):
        dataset_info(Broken(lambda i: ((), 0)))
    with pytest.raises(ConfigError, match=r"data set: x\[1\] cannot be stacked.*got shapes \[\(1,\), \(2,\)\]"):
        get_batch(Broken(lambda i: ((torch.zeros(3), torch.zeros(1 + i % 2)), 0)), [0, 1])


def test_a_dataloader_of_seq2seq_samples_gives_lists_that_unpack_alike():
    data = Broken(lambda i: ((torch.arange(4) + i, torch.arange(3) * i), torch.arange(3)))
    batches = LoaderBatches(DataLoader(data, batch_size=2, shuffle=False))
    x, y = batches.batch(1)
    assert isinstance(x, list) and [t.shape for t in x] == [(2, 4), (2, 3)]  # default_collate's list
    assert x[0][:, 0].tolist() == [2, 3] and y.shape == (2, 3)
    batches.close()
