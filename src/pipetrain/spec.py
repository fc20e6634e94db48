"""Parsing of `--model` / `--data` specs: a built-in name or `PKG.MOD:FACTORY`, with `k=v` options.

Grammar (one string, no spaces needed)::

    NAME                      built-in, default options      mlp
    NAME:k=v,k2=v2            built-in with options          mlp:depth=8,width=1024
    PKG.MOD:FACTORY           factory imported by name       mypkg.nets:make_net
    PKG.MOD:FACTORY:k=v,...   factory with keyword options   mypkg.nets:make_net:width=64

A spec is a factory reference when its first part is not a built-in name and the text after the
first ``:`` starts with an identifier that is not followed by ``=``; otherwise it is a built-in name
with options. A module without a dot (``mymodule:factory``) is a factory reference too, unless it
is spelled like a built-in (``mlp:depth`` is a malformed built-in spec, not module ``mlp``).

Values are parsed in this order: ``true``/``false`` (any case) -> bool, ``none`` -> None, an integer,
a float, a ``/``-separated list whose every item is a number (``64/128/256`` -> ``[64, 128, 256]``),
and otherwise the string itself (so ``path=/tmp/x.pt`` stays a string).

Factories are imported with the current directory first on ``sys.path`` (then PYTHONPATH), so a
file ``./mynets.py`` is reachable as ``mynets:factory`` from wherever `pipetrain` runs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.usercode import where

__all__ = ["Spec", "parse_spec", "parse_value", "format_spec", "resolve_factory", "call_factory", "describe_exception"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)$", re.I)


@dataclass(frozen=True)
class Spec:
    """A parsed spec: either a built-in ``name`` or a ``module``/``factory`` pair, plus options.

    ``text`` is the original string, kept for messages and reports.
    """

    name: str | None
    module: str | None
    factory: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    @property
    def is_builtin(self) -> bool:
        return self.name is not None

    @property
    def label(self) -> str:
        """``name`` for a built-in, ``module:factory`` otherwise (no options)."""
        return self.name if self.name is not None else f"{self.module}:{self.factory}"


def parse_value(text: str) -> Any:
    """Parse one option value: bool, None, int, float, numeric ``a/b`` list, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if re.fullmatch(r"[+-]?\d+", low):
        return int(low)
    if _NUMBER.fullmatch(low):
        return float(low)
    if "/" in text:
        items = text.split("/")
        if all(_NUMBER.fullmatch(item.strip()) for item in items):
            return [parse_value(item) for item in items]
    return text


def _parse_kwargs(text: str, spec: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    items = text.split(",")
    if items and items[-1] == "":
        items = items[:-1]  # tolerate a trailing comma
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not _IDENT.match(key):
            raise ConfigError(
                f"spec {spec!r}: option {item!r} is not of the form key=value "
                f"(options are comma-separated, e.g. 'mlp:depth=8,width=1024')"
            )
        if key in kwargs:
            raise ConfigError(f"spec {spec!r}: option {key!r} is given twice")
        kwargs[key] = parse_value(value)
    return kwargs


def parse_spec(text: str, *, builtins: Iterable[str] | None = None, kind: str = "spec") -> Spec:
    """Parse ``text`` into a :class:`Spec`.

    ``builtins``, when given, are the valid built-in names: an unknown name raises
    :class:`ConfigError` listing them and suggesting the closest. ``kind`` (``"model"``, ``"data"``)
    only words the messages.
    """
    original = text
    text = text.strip()
    if not text:
        raise ConfigError(f"empty {kind} spec: give a built-in name or PKG.MOD:FACTORY")
    head, colon, tail = text.partition(":")
    head = head.strip()
    first = re.split(r"[:,]", tail, maxsplit=1)[0] if colon else ""
    known = builtins is not None and head in set(builtins)
    is_factory = colon and not known and "=" not in first and first.strip() != ""
    if is_factory:
        factory, _, options = tail.partition(":")
        factory = factory.strip()
        if not _MODULE.match(head):
            raise ConfigError(
                f"{kind} spec {original!r}: {head!r} is not a Python module path (PKG.MOD:FACTORY)"
            )
        if not _IDENT.match(factory):
            raise ConfigError(
                f"{kind} spec {original!r}: {factory!r} is not a Python name; write "
                f"PKG.MOD:FACTORY or PKG.MOD:FACTORY:k=v,..."
            )
        return Spec(None, head, factory, _parse_kwargs(options, original) if options else {}, original)
    if "." in head:
        raise ConfigError(
            f"{kind} spec {original!r}: a module path needs a factory name after a colon, "
            f"e.g. '{head}:make_model'"
        )
    if not _NAME.match(head):
        raise ConfigError(f"{kind} spec {original!r}: {head!r} is not a valid name")
    if builtins is not None:
        valid = sorted(builtins)
        if head not in valid:
            close = difflib.get_close_matches(head, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {kind} {head!r}: built-in {kind}s are {', '.join(valid)}, or give "
                f"PKG.MOD:FACTORY to import your own.{hint}"
            )
    return Spec(head, None, None, _parse_kwargs(tail, original) if tail else {}, original)


def format_spec(spec: Spec) -> str:
    """The canonical string of ``spec`` (parses back to an equal Spec, up to ``text``)."""

    def fmt(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None:
            return "none"
        if isinstance(value, (list, tuple)):
            return "/".join(fmt(v) for v in value)
        return str(value)

    options = ",".join(f"{k}={fmt(v)}" for k, v in spec.kwargs.items())
    base = spec.label
    if not options:
        return base
    return f"{base}:{options}"


def resolve_factory(spec: Spec, *, kind: str = "spec") -> Callable[..., Any]:
    """Import ``spec.module`` (current directory first, then PYTHONPATH) and return the factory."""
    if spec.module is None or spec.factory is None:
        raise ConfigError(f"{kind} spec {spec.text!r} names a built-in, not PKG.MOD:FACTORY")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(spec.module)
    except Exception as error:  # noqa: BLE001 - any import-time failure is the user's to fix
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        raise ConfigError(
            f"{kind} spec {spec.text!r}: cannot import module {spec.module!r} ({detail}); "
            f"the current directory ({cwd}) and PYTHONPATH are searched"
        ) from error
    if not hasattr(module, spec.factory):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        close = difflib.get_close_matches(spec.factory, public, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{kind} spec {spec.text!r}: module {spec.module!r} has no attribute "
            f"{spec.factory!r}.{hint}"
        )
    factory = getattr(module, spec.factory)
    if not callable(factory):
        raise ConfigError(
            f"{kind} spec {spec.text!r}: {spec.module}.{spec.factory} is a "
            f"{type(factory).__name__}, not a callable factory"
        )
    return factory


def describe_exception(error: BaseException) -> str:
    """``"ValueError: bad record (data.py:12, in __getitem__)"``: an exception raised by a user's
    code in one line, with the place in the user's code it came from
    (:func:`pipetrain.usercode.where`), instead of a traceback."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}{': ' + text[0] if text else ''}{where(error)}"


def _call(factory: Callable[..., Any], kwargs: Mapping[str, Any], what: str) -> Any:
    """``factory(**kwargs)``; an exception of the user's code becomes one ConfigError naming it."""
    try:
        return factory(**kwargs)
    except PipetrainError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever a user's factory raises, say so in one line
        raise ConfigError(f"{what} raised {describe_exception(error)}") from None


def _accepted(signature: inspect.Signature) -> list[str]:
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def call_factory(
    factory: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    extra: Mapping[str, Any] | None = None,
    what: str = "factory",
) -> Any:
    """Call ``factory(**kwargs, **extra')`` with errors that name the accepted parameters.

    ``kwargs`` are the user's options: one the factory does not accept is a :class:`ConfigError`.
    ``extra`` are values pipetrain offers (``input_shape``, ``num_classes``, ...): each is passed
    only if the factory has a parameter of that name or takes ``**kwargs``, and a user option of
    the same name wins.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    call_kwargs = dict(kwargs)
    if signature is not None:
        params = signature.parameters
        var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = _accepted(signature)
        for key, value in (extra or {}).items():
            if key not in call_kwargs and (var_kw or key in accepted):
                call_kwargs[key] = value
        if not var_kw:
            unknown = [k for k in kwargs if k not in accepted]
            if unknown:
                options = [a for a in accepted if a not in (extra or {})]  # extras come from pipetrain
                close = difflib.get_close_matches(unknown[0], options, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{what} does not accept option {unknown[0]!r}; accepted: "
                    f"{', '.join(options) if options else '(none)'}.{hint}"
                )
        try:
            signature.bind(**call_kwargs)
        except TypeError as error:
            raise ConfigError(
                f"{what}: {error}; accepted parameters: {', '.join(accepted) or '(none)'}"
            ) from error
        return _call(factory, call_kwargs, what)
    try:
        return factory(**call_kwargs)
    except PipetrainError:
        raise
    except TypeError as error:
        raise ConfigError(f"{what} rejected options {sorted(call_kwargs)}: {error}") from error
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"{what} raised {describe_exception(error)}") from None
