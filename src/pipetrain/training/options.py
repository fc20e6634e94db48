"""One declaration per training option: a :class:`TrainConfig` field whose metadata says
everything else about it, so that adding an option touches one place.

From these declarations come the parser of `pipetrain train` (:func:`pipetrain.commands.train.add_arguments`),
the keyword arguments of :class:`~pipetrain.Pipeline` and its ``fit`` (:mod:`pipetrain.pipeline`),
the per-option checks (:func:`pipetrain.training.validate.check_config`) and the checkpoint
fingerprint (:meth:`TrainConfig.fingerprint`). An error about an option names its field
(:func:`pipetrain.errors.option`); the command line prints the field's flag, Python its keyword.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from pipetrain.errors import ArgumentError, ConfigError
from pipetrain.errors import option as option_name
from pipetrain.spec import parse_value
from pipetrain.training.api_types import checked_value

__all__ = ["Flag", "Option", "option", "declared", "flag_of", "keyword_of", "api_values", "api_signature",
           "declared_check",
           "one_of", "at_least", "entries_at_least", "whole_number", "API_STAGES", "GROUPS", "int_list",
           "name_list", "key_values"]

#: The help screen's groups, in the order `pipetrain train --help` shows them.
GROUPS = ("model and data", "pipeline", "training", "execution", "outputs")
#: Where an option is a Python keyword: ``Pipeline(...)`` or ``Pipeline.fit(...)``.
API_STAGES = ("pipeline", "fit")
_UNSET: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its name and the argparse details (``type``, ``choices``, ``metavar``,
    ``action``, ``nargs``, ``const``); its ``dest`` is the field's name unless given."""

    name: str
    help: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    dest: str | None = None


@dataclass(frozen=True)
class Option:
    """What a :class:`TrainConfig` field is to the user (see :func:`option`)."""

    help: str
    group: str | None
    flags: tuple[Flag, ...]
    from_cli: Callable[[argparse.Namespace], Any] | None
    check: Callable[[str, Any], None] | None
    fingerprint: bool | Callable[[Any], bool]
    api: str | None
    keyword: str | None
    api_default: Any
    from_api: Callable[[Any], Any] | None
    api_type: str | None


def option(default: Any = _UNSET, *, help: str, group: str | None = None, flag: str | bool | None = None,
           flag_help: str | None = None, flags: tuple[Flag, ...] | None = None,
           from_cli: Callable[[argparse.Namespace], Any] | None = None,
           check: Callable[[str, Any], None] | None = None,
           fingerprint: bool | Callable[[Any], bool] = False, api: str | None = None, keyword: str | None = None,
           api_default: Any = _UNSET, from_api: Callable[[Any], Any] | None = None, api_type: str | None = None,
           default_factory: Callable[[], Any] | None = None, **details: Any) -> Any:
    """A :class:`TrainConfig` field declared as an option.

    ``help``: what it does (the field's documentation; also the flag's help unless ``flag_help``).
    ``group``: its section of the help screen (one of :data:`GROUPS`; None for an option with no flag).
    ``flag``: its command-line name (default ``--field-name``; False: none), with argparse's
    ``details`` (``type=int``, ``choices=...``, ``metavar=...``, ``action=...``); ``flags``: several
    flags instead, and ``from_cli(args)`` the value they give (default: the flag's own value).
    ``check(field, value)``: raises a :class:`~pipetrain.errors.ConfigError` naming the option
    (:func:`pipetrain.errors.option`) for a bad value other than None (default: the flag's
    ``choices``, where the flag's value is the field's; see :func:`one_of`, :func:`at_least`).
    ``fingerprint``: whether a checkpoint must agree on it to be resumed (or ``f(config)``: when).
    ``api``: ``"pipeline"`` or ``"fit"``, where it is a Python keyword (named ``keyword``, default
    the field's name; ``api_default`` where Python's default differs from the command line's;
    ``from_api(value)``: the field's value of what Python was given, such as a list of a tuple;
    ``api_type``: what Python takes, where it is more than the field's type).
    """
    if flags is None:
        flags = () if flag is False else (Flag(flag or "", flag_help or help, details),)  # "" -> --field-name
    elif details:
        raise TypeError("give argparse details on each Flag of flags=")
    if check is None and from_cli is None and flags and "choices" in flags[0].details:
        check = one_of(*flags[0].details["choices"])
    if api is not None and api not in API_STAGES:
        raise ValueError(f"api must be one of {API_STAGES}, not {api!r}")
    if group is not None and group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, not {group!r}")
    meta = {"option": Option(help, group, flags, from_cli, check, fingerprint, api, keyword, api_default,
                             from_api, api_type)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared(config_type: type) -> list[tuple[dataclasses.Field, Option]]:
    """Every declared field of ``config_type`` with its :class:`Option`, in declaration order (the
    flags' order on the help screen)."""
    return [(field, field.metadata["option"]) for field in dataclasses.fields(config_type)
            if "option" in field.metadata]


def declared_check(config_type: type, name: str) -> Callable[[str, Any], None]:
    """The check declared with field ``name`` (one that accepts anything where none is)."""
    check = next(d.check for f, d in declared(config_type) if f.name == name)
    return check or (lambda field, value: None)


def flag_name(field: dataclasses.Field, flag: Flag) -> str:
    return flag.name or "--" + field.name.replace("_", "-")


def flag_of(config_type: type) -> dict[str, str]:
    """Field name -> the flag that sets it (its first), for the command line's error messages."""
    return {field.name: flag_name(field, option.flags[0]) for field, option in declared(config_type) if option.flags}


def keyword_of(config_type: type) -> dict[str, str]:
    """Field name -> its Python keyword, for the Python API's error messages."""
    return {field.name: option.keyword or field.name for field, option in declared(config_type) if option.api}


def _keywords(config_type: type, stage: str) -> list[tuple[str, dataclasses.Field, Option]]:
    return [(declaration.keyword or field.name, field, declaration) for field, declaration in declared(config_type)
            if declaration.api == stage]


def _api_default(field: dataclasses.Field, declaration: Option) -> Any:
    if declaration.api_default is not _UNSET:
        return declaration.api_default
    return field.default_factory() if field.default is _UNSET else field.default


def api_values(config_type: type, stage: str, given: dict[str, Any], caller: str) -> dict[str, Any]:
    """Field name -> value of the keywords of ``stage`` (``"pipeline"`` or ``"fit"``) that
    ``caller`` was given, each absent one at its Python default; ``from_api`` applied. An unknown
    keyword, or a value outside the type the signature shows, is an
    :class:`~pipetrain.errors.ArgumentError` (a ConfigError and a TypeError, as Python's own),
    an unknown keyword naming the closest one."""
    keywords = _keywords(config_type, stage)
    known = {keyword for keyword, _, _ in keywords}
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise ArgumentError(f"{caller} got an unexpected keyword argument {name!r}"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
    values = {}
    for keyword, field, declaration in keywords:
        if keyword in given:
            value = checked_value(field.name, keyword, given[keyword], declaration.api_type or str(field.type), caller)
        else:
            value = _api_default(field, declaration)
        values[field.name] = declaration.from_api(value) if declaration.from_api and value is not None else value
    return values


def api_signature(config_type: type, stage: str, head: list, returns: Any, tail: list | None = None):
    """The :class:`inspect.Signature` of a function taking ``head``'s parameters, the keywords of
    ``stage`` and ``tail``'s: what ``help()`` and editors show of the keywords taken as ``**options``."""
    declared_keywords = [
        inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=_api_default(field, declaration),
                          annotation=declaration.api_type or field.type)
        for keyword, field, declaration in _keywords(config_type, stage)]
    return inspect.Signature([*head, *declared_keywords, *(tail or [])], return_annotation=returns)


# -- checks of one value -------------------------------------------------------------------------


def one_of(*choices: str) -> Callable[[str, Any], None]:
    """The value must be one of ``choices``."""
    def check(field: str, value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"unknown {option_name(field)} {value!r}; choose one of {', '.join(choices)}")

    return check


def at_least(low: float, *, strict: bool = False) -> Callable[[str, Any], None]:
    """The value must be at least ``low`` (``strict``: greater than)."""
    def check(field: str, value: Any) -> None:
        if value < low or (strict and value == low):
            raise ConfigError(f"{option_name(field)} must be {'greater than' if strict else 'at least'} {low:g}, "
                              f"got {value:g}")

    return check


def entries_at_least(low: int) -> Callable[[str, Any], None]:
    """Every entry of the list must be at least ``low``."""
    def check(field: str, values: Any) -> None:
        if any(v < low for v in values):
            raise ConfigError(f"{option_name(field)} {','.join(map(str, values))}: every entry must be at least {low}")

    return check


def whole_number(low: int, meaning: str = "") -> Callable[[str, Any], None]:
    """The value must be an integer (not a bool) of at least ``low``; ``meaning`` says what the lowest does."""
    def check(field: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{option_name(field)} must be an integer >= {low}{meaning}, got {value!r}")

    return check


# -- text values of flags (argparse types) -------------------------------------------------------


def int_list(text: str) -> list[int]:
    """``2,2,1`` -> ``[2, 2, 1]``."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 2,2,1; got {text!r}") from None


def name_list(text: str) -> list[str]:
    """``a, b`` -> ``["a", "b"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def key_values(text: str) -> dict:
    """``k=v,...`` with values parsed as in specs (true/false/none, numbers, else strings)."""
    options = {}
    for item in (part for part in text.split(",") if part.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE,..., e.g. use_cache=false; got {item!r}")
        options[key.strip()] = parse_value(value)
    return options
