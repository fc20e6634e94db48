"""Parsing of ``name:key=value,...`` spec strings into checked, typed options."""

from __future__ import annotations

import math
from typing import Callable, Mapping

from pipetrain.errors import ConfigError

__all__ = ["split_spec", "parse_options", "as_float", "as_count", "as_bool", "as_float_pair"]


def split_spec(text: str, what: str, names: Mapping[str, object]) -> tuple[str, dict[str, str]]:
    """Split ``name:k=v,k=v`` into the name and raw option strings; the name must be in ``names``.

    ``what`` names the kind of spec in error messages (``"optimizer"``, ``"lr schedule"``).
    """
    text = text.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if name not in names:
        raise ConfigError(
            f"unknown {what} {name!r} in {text!r}; valid names: {', '.join(sorted(names))}"
        )
    raw: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or not key or not value.strip():
            raise ConfigError(f"{what} option {item!r} in {text!r} must have the form key=value")
        if key in raw:
            raise ConfigError(f"{what} option {key!r} is given twice in {text!r}")
        raw[key] = value.strip()
    return name, raw


def parse_options(
    name: str,
    raw: Mapping[str, str],
    parsers: Mapping[str, Callable[[str, str], object]],
    what: str,
) -> dict[str, object]:
    """Convert each raw option with its parser; an unknown key lists the valid ones."""
    options: dict[str, object] = {}
    for key, value in raw.items():
        if key not in parsers:
            raise ConfigError(
                f"unknown option {key!r} for {what} {name!r}; valid options: "
                f"{', '.join(sorted(parsers))}"
            )
        options[key] = parsers[key](key, value)
    return options


def as_float(key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(
            f"option {key}={value!r} must be a number, for example {key}=0.1"
        ) from None
    if not math.isfinite(number):
        raise ConfigError(f"option {key}={value!r} must be a finite number")
    return number


def as_count(key: str, value: str) -> int:
    """A whole number of samples; ``1e6`` and ``1_000_000`` are accepted."""
    number = as_float(key, value.replace("_", ""))
    if number != int(number) or number < 0:
        raise ConfigError(
            f"option {key}={value!r} must be a whole number >= 0 (a count of samples)"
        )
    return int(number)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def as_bool(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"option {key}={value!r} must be true or false")


def as_float_pair(key: str, value: str) -> tuple[float, float]:
    """Two numbers separated by ``/``, for example ``betas=0.9/0.999``."""
    parts = value.split("/")
    if len(parts) != 2:
        raise ConfigError(f"option {key}={value!r} must be two numbers separated by '/', "
                          f"for example {key}=0.9/0.999")
    return as_float(key, parts[0]), as_float(key, parts[1])
