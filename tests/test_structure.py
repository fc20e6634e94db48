"""pipetrain.structure: values of tensors in tuples, lists and dicts, flattened and built again."""

from __future__ import annotations

import pickle
from collections import namedtuple

import pytest
import torch

from pipetrain.errors import ConfigError
from pipetrain.structure import (
    Structure,
    append,
    arguments,
    cast_floating,
    describe,
    first_tensor,
    flatten,
    leaf_paths,
    rows,
    split_last,
    stack,
)

a, b, c = torch.zeros(2, 3), torch.ones(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool)


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x is y
    if type(x) is not type(y) or len(x) != len(y):
        return False
    if isinstance(x, dict):
        return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    return all(same(p, q) for p, q in zip(x, y))


def test_a_tensor_and_a_flat_tuple_have_no_structure():
    assert flatten(a) == ((a,), None)
    pair = (a, b)
    leaves, structure = flatten(pair)
    assert leaves is pair and structure is None


@pytest.mark.parametrize("value", [
    ((a, b), c), [a, b], {"input_ids": b, "attention_mask": c}, {"x": (a, [b, {"m": c}])}, (a, ()), ((a,),),
], ids=["nested-tuple", "list", "dict", "deep", "empty-tuple", "one-tuple"])
def test_flatten_and_unflatten_give_back_the_value(value):
    leaves, structure = flatten(value)
    assert structure is not None and structure.count == len(leaves)
    assert same(structure.unflatten(leaves), value)
    assert Structure.parse(structure.text) is structure  # parsed once per text
    assert pickle.loads(pickle.dumps(structure)) == structure


def test_the_text_and_the_paths():
    leaves, structure = flatten({"ids": b, "pair": (a, [c])})
    assert structure.text == '{"ids":*,"pair":(*,[*])}'
    assert structure.paths() == ["['ids']", "['pair'][0]", "['pair'][1][0]"]
    assert leaf_paths(a) == [""] and leaf_paths((a, b)) == ["[0]", "[1]"]
    assert [t is s for t, s in zip(leaves, (b, a, c))] == [True, True, True]
    assert flatten({'a "quoted": key': a})[1].paths() == ["['a \"quoted\": key']"]


def test_a_named_tuple_is_flat_and_dict_keys_must_be_strings():
    Pair = namedtuple("Pair", "x y")
    leaves, structure = flatten(Pair(a, b))
    assert structure is None and leaves == Pair(a, b)
    with pytest.raises(ConfigError, match="string keys.*got the key 1"):
        flatten({1: a})


def test_the_call_convention():
    assert arguments((a, b)) == ((a, b), {})
    assert arguments([a, b]) == ((a, b), {})
    assert arguments({"x": a}) == ((), {"x": a})
    assert arguments(a) == ((a,), {})


def test_rows_cast_and_first_tensor():
    x = {"ids": torch.arange(12).view(6, 2), "w": torch.ones(6, 2, dtype=torch.float64), "m": torch.ones(6) > 0}
    part = rows(x, 2, 5)
    assert torch.equal(part["ids"], x["ids"][2:5]) and part["m"].shape == (3,)
    cast = cast_floating(x, torch.float32)
    assert cast["w"].dtype == torch.float32 and cast["ids"] is x["ids"] and cast["m"] is x["m"]
    assert cast_floating(x, None) is x
    assert first_tensor(((), [x["w"]])) is x["w"] and first_tensor(()) is None


def test_stack_builds_a_batch_leaf_by_leaf_and_names_what_does_not_fit():
    samples = [{"ids": torch.arange(3) + i, "pair": (torch.zeros(2), torch.ones(1))} for i in range(4)]
    batch = stack(samples)
    assert batch["ids"].shape == (4, 3) and batch["pair"][1].shape == (4, 1)
    samples[2]["pair"] = (torch.zeros(3), torch.ones(1))
    with pytest.raises(ConfigError, match=r"x\['pair'\]\[0\] cannot be stacked.*got shapes \[\(2,\), \(3,\)\]"):
        stack(samples)
    with pytest.raises(ConfigError, match=r"x of sample 1 of the batch is built differently"):
        stack([(a, b), {"a": a, "b": b}])
    with pytest.raises(ConfigError, match=r"x\[1\] must be a torch.Tensor in every sample, got str"):
        stack([(a, "no"), (a, "no")])


def test_append_and_split_last_keep_the_fast_path_flat():
    flat = (a, b)
    assert append(flat, c) == (a, b, c) and split_last((a, b, c)) == ((a, b), c)
    for value in (((a, b), c), {"x": a}, [a]):
        payload = append(value, b)
        assert payload == (value, b) and same(split_last(payload)[0], value)
    assert split_last(append((), c)) == ((), c)


def test_describe():
    assert describe(b) == "(2,) int64"
    assert describe({"ids": b, "m": c}) == "['ids'] (2,) int64, ['m'] (2, 4) bool"
