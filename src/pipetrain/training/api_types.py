"""The Python API's keywords checked against the types their signature shows, when they are given.

``Pipeline(microbatches="4")`` or ``fit(steps="100")`` would otherwise get as far as a comparison
deep in the set-up and stop there with ``TypeError: '<' not supported between instances of 'str'
and 'int'``, and ``split_at="layer3"`` would be read letter by letter. The annotation each keyword
shows in ``help(Pipeline)`` (its field's type, or the ``api_type`` declared with it) is the
contract: a value outside it is refused at the call with an
:class:`~pipetrain.errors.ArgumentError` naming the keyword, what it takes and what it got.

Only what an annotation says plainly is checked: ``None``, ``int`` (not ``bool``), ``float`` (any
real number), ``str`` (or a path object, given on as its text), ``bool``, ``type``, a function
(``Callable[...]``, ``OptimizerFactory``), ``list[...]`` / ``Sequence[...]`` (a list or tuple,
every entry checked) and ``dict[...]``. Anything else (``Any``) is taken as it is.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable

from pipetrain.errors import ArgumentError, option

__all__ = ["checked_value"]

_FUNCTIONS = ("Callable", "OptimizerFactory")


def _alternatives(annotation: str) -> list[str]:
    """``"str | Callable[[A, B], C] | None"`` -> ``["str", "Callable[[A, B], C]", "None"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(annotation):
        depth += char == "["
        depth -= char == "]"
        if char == "|" and depth == 0:
            parts.append(annotation[start:i].strip())
            start = i + 1
    parts.append(annotation[start:].strip())
    return parts


def _accepts(annotation: str) -> Callable[[Any], bool]:
    """Whether a value fits ``annotation`` (one that says nothing plainly accepts everything)."""
    tests = [_accepts_one(part) for part in _alternatives(annotation)]
    return lambda value: any(test(value) for test in tests)


def _accepts_one(kind: str) -> Callable[[Any], bool]:
    head, _, inner = kind.partition("[")
    if kind == "None":
        return lambda value: value is None
    if kind == "bool":
        return lambda value: isinstance(value, bool)
    if kind == "int":
        return lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "str":
        return lambda value: isinstance(value, (str, os.PathLike))
    if kind == "type":
        return lambda value: isinstance(value, type)
    if head in _FUNCTIONS:
        return callable
    if head in ("list", "tuple", "Sequence") and inner:
        entry = _accepts(inner[:-1])
        return lambda value: isinstance(value, (list, tuple)) and all(entry(v) for v in value)
    if head in ("dict", "Mapping"):
        return lambda value: isinstance(value, dict)
    return lambda value: True


def checked_value(field: str, keyword: str, value: Any, annotation: str, caller: str) -> Any:
    """``value`` of ``keyword`` (field ``field``) if it fits ``annotation`` (a path object as its
    text where a ``str`` is taken), else an :class:`~pipetrain.errors.ArgumentError`."""
    if not _accepts(annotation)(value):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ArgumentError(f"{caller}: {option(field)} takes {annotation}, not {type(value).__name__} {shown}")
    if isinstance(value, os.PathLike) and not isinstance(value, str) and "str" in _alternatives(annotation):
        return os.fspath(value)
    return value
