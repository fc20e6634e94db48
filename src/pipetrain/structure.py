"""Values of any structure: tensors in tuples, lists and dicts, flattened into their tensors and back.

A model input, a stage's output and a message may be one tensor, a tuple of tensors, or any nesting
of tuples, lists and dicts of tensors (``((src, tgt_in), tgt)``, ``{"input_ids": ..., "attention_mask":
...}``). Executors and the wire work on the flat tuple of its tensors (its *leaves*, in order: tuple
and list items in order, dict values in insertion order); a :class:`Structure` says how to build the
value again. The common cases, a tensor and a flat tuple of tensors, have no structure (``None``)
and cost nothing to flatten: only other values pay for carrying their shape.

A structure is written as short text (``((*,*),*)``, ``{"input_ids":*,"attention_mask":*}``: ``*`` a
leaf, ``()`` a tuple, ``[]`` a list, ``{}`` a dict with JSON-quoted string keys), which is what a
message carries, and parsed once per distinct text.

The call convention (:mod:`pipetrain.stages.staged`) reads a value as arguments: a tuple or list is
unpacked into positional arguments, a dict into keyword arguments, anything else is the one argument
(:func:`arguments`).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from pipetrain.errors import ConfigError

__all__ = ["Structure", "flatten", "arguments", "map_values", "tensors_of", "cast_floating", "rows", "stack",
           "append", "split_last", "first_tensor", "leaf_paths", "describe"]

_CONTAINERS = (tuple, list, dict)


class Structure:
    """How to build a value from its leaves: parsed from its text (:meth:`parse`, cached)."""

    __slots__ = ("text", "count", "_tree")

    def __init__(self, text: str, tree: Any, count: int) -> None:
        self.text = text
        self.count = count
        self._tree = tree

    def __repr__(self) -> str:
        return f"Structure({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Structure) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __reduce__(self):  # pickles (checkpoints, worker messages) as its text
        return (Structure.parse, (self.text,))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(text: str) -> "Structure":
        """The structure written as ``text`` (see the module docstring)."""
        tree, end, count = _parse(text, 0)
        if end != len(text):
            raise ValueError(f"not a structure: {text!r} (unexpected {text[end:]!r})")
        return Structure(text, tree, count)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """The value whose leaves are ``leaves`` (as many as :attr:`count`)."""
        if len(leaves) != self.count:
            raise ValueError(f"structure {self.text} holds {self.count} leaves, got {len(leaves)}")
        return _build(self._tree, iter(leaves))

    def paths(self) -> list[str]:
        """Where each leaf sits, as indexing text: ``[0][1]``, ``['input_ids']``."""
        out: list[str] = []
        _paths(self._tree, "", out)
        return out


def _parse(text: str, i: int) -> tuple[Any, int, int]:
    """``(tree, next index, leaf count)`` of the structure starting at ``text[i]``."""
    char = text[i] if i < len(text) else ""
    if char == "*":
        return None, i + 1, 1
    if char in "([":
        close = ")" if char == "(" else "]"
        items, count, i = [], 0, i + 1
        while text[i] != close:
            item, i, n = _parse(text, i)
            items.append(item)
            count += n
            if text[i] == ",":
                i += 1
        return (tuple if char == "(" else list, items), i + 1, count
    if char == "{":
        pairs, count, i = [], 0, i + 1
        decoder = json.JSONDecoder()
        while text[i] != "}":
            key, i = decoder.raw_decode(text, i)
            if text[i] != ":":
                raise ValueError(f"not a structure: {text!r} (':' expected at {i})")
            item, i, n = _parse(text, i + 1)
            pairs.append((key, item))
            count += n
            if text[i] == ",":
                i += 1
        return (dict, pairs), i + 1, count
    raise ValueError(f"not a structure: {text!r} (at {i})")


def _build(tree: Any, leaves: Iterator[Any]) -> Any:
    if tree is None:
        return next(leaves)
    kind, items = tree
    if kind is dict:
        return {key: _build(item, leaves) for key, item in items}
    built = [_build(item, leaves) for item in items]
    return tuple(built) if kind is tuple else built


def _paths(tree: Any, prefix: str, out: list[str]) -> None:
    if tree is None:
        out.append(prefix)
        return
    kind, items = tree
    for key, item in (items if kind is dict else enumerate(items)):
        _paths(item, f"{prefix}[{key!r}]", out)


def _walk(value: Any, leaves: list, parts: list[str]) -> None:
    if isinstance(value, (tuple, list)):
        parts.append("(" if isinstance(value, tuple) else "[")
        for n, item in enumerate(value):
            if n:
                parts.append(",")
            _walk(item, leaves, parts)
        parts.append(")" if isinstance(value, tuple) else "]")
    elif isinstance(value, dict):
        parts.append("{")
        for n, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise ConfigError(
                    f"a dict that crosses a stage boundary or feeds a model must have string keys (they become "
                    f"keyword arguments), got the key {key!r}"
                )
            if n:
                parts.append(",")
            parts.append(json.dumps(key))
            parts.append(":")
            _walk(item, leaves, parts)
        parts.append("}")
    else:
        leaves.append(value)
        parts.append("*")


def flatten(value: Any) -> tuple[tuple, Structure | None]:
    """``(leaves, structure)``: a tensor is ``((value,), None)``, a flat tuple (no containers
    inside) is ``(value, None)``; anything else its leaves and its :class:`Structure` (named tuples
    become tuples)."""
    if isinstance(value, tuple):
        for item in value:
            if isinstance(item, _CONTAINERS):
                break
        else:
            return value, None
    elif not isinstance(value, _CONTAINERS):
        return (value,), None
    leaves: list = []
    parts: list[str] = []
    _walk(value, leaves, parts)
    return tuple(leaves), Structure.parse("".join(parts))


def arguments(value: Any) -> tuple[tuple, dict[str, Any]]:
    """The call convention: ``(args, kwargs)`` to call a module with ``value``."""
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    if isinstance(value, dict):
        return (), value
    return (value,), {}


def tensors_of(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_of(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_of(item)


def map_values(value: Any, fn: Callable[[Any], Any], kind: type = Tensor) -> Any:
    """``value`` with ``fn`` applied to every item of type ``kind`` inside it (named tuples keep
    their type); everything else is kept as it is."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, tuple):
        mapped = [map_values(v, fn, kind) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)
    if isinstance(value, list):
        return [map_values(v, fn, kind) for v in value]
    if isinstance(value, dict):
        return {k: map_values(v, fn, kind) for k, v in value.items()}
    return value


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` with every floating-point tensor in ``dtype`` (integer and boolean ones, token
    ids and masks, stay as they are); ``dtype`` None: unchanged."""
    if dtype is None:
        return value

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast(value) if isinstance(value, Tensor) else map_values(value, cast)


def rows(value: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch: every tensor of ``value`` sliced along dimension 0."""
    if isinstance(value, Tensor):
        return value[start:stop]
    return map_values(value, lambda t: t[start:stop])


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor of ``value`` (its first leaf that is one), or None."""
    return next(tensors_of(value), None)


def leaf_paths(value: Any) -> list[str]:
    """Indexing text of each leaf of ``value`` (``[""]`` for a tensor, ``["[0]", "[1]"]`` ...)."""
    if not isinstance(value, _CONTAINERS):
        return [""]
    leaves: list = []
    parts: list[str] = []
    _walk(value, leaves, parts)
    return Structure.parse("".join(parts)).paths()


def describe(value: Any) -> str:
    """Shapes and dtypes of a value's tensors, for messages: ``(4, 12) int64`` or ``[0] (4, 12) int64, ...``."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, Tensor):
            return f"{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        return type(leaf).__name__

    leaves, structure = flatten(value)
    if structure is None and isinstance(value, Tensor):
        return one(value)
    paths = structure.paths() if structure is not None else [f"[{i}]" for i in range(len(leaves))]
    return ", ".join(f"{path} {one(leaf)}" for path, leaf in zip(paths, leaves))


def stack(values: Sequence[Any], what: str = "x") -> Any:
    """Values of one structure stacked leaf by leaf along a new dimension 0. A leaf that cannot be
    stacked (another shape, another structure, not a tensor) is a :class:`ConfigError` naming its
    path, e.g. ``x['attention_mask']``."""
    if isinstance(values[0], Tensor):
        return torch.stack(list(values))
    first, structure = flatten(values[0])
    if structure is None:  # a flat tuple
        structure = Structure.parse("(" + ",".join("*" * len(first)) + ")")
    paths = structure.paths()
    columns: list[list[Any]] = [[] for _ in paths]
    for n, value in enumerate(values):
        leaves, other = flatten(value)
        if len(leaves) != len(paths) or (other is not None and other != structure):
            raise ConfigError(
                f"{what} of sample {n} of the batch is built differently from the first's ({describe(value)} "
                f"against {describe(values[0])}): every sample's {what} must have one structure"
            )
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    out = []
    for path, column in zip(paths, columns):
        kinds = sorted({type(leaf).__name__ for leaf in column if not isinstance(leaf, Tensor)})
        if kinds:
            raise ConfigError(f"{what}{path} must be a torch.Tensor in every sample, got {', '.join(kinds)}")
        try:
            out.append(torch.stack(column))
        except RuntimeError as error:
            shapes = sorted({tuple(t.shape) for t in column})
            raise ConfigError(
                f"{what}{path} cannot be stacked into a batch ({str(error).splitlines()[0]}): it must have one "
                f"shape in every sample, got shapes {shapes[:4]}"
            ) from None
    return structure.unflatten(out)


def append(value: Any, extra: Any) -> tuple:
    """``value`` with ``extra`` after it, as one payload: a flat tuple grows by one item (the fast
    path), anything else becomes ``(value, extra)``. :func:`split_last` takes it apart."""
    if isinstance(value, tuple) and not any(isinstance(item, _CONTAINERS) for item in value):
        return value + (extra,)
    return (value, extra)


def split_last(payload: tuple) -> tuple[Any, Any]:
    """``(value, extra)`` of a payload made by :func:`append`."""
    if payload and isinstance(payload[0], _CONTAINERS):
        return payload[0], payload[1]
    return payload[:-1], payload[-1]
