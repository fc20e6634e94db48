"""The one typed value of a run's first values (pipetrain.initialiser): what each spelling gives."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipetrain.errors import ConfigError
from pipetrain.initialiser import Init, init_from_flags, resolve_init


def first_values(module, name):
    pass


def test_each_python_spelling_resolves_to_one_init():
    assert resolve_init(None) is None
    assert resolve_init("reset") == Init("reset")
    assert resolve_init("weights/dir") == Init("weights", path="weights/dir")
    assert resolve_init(first_values) == Init("function", function=first_values)
    given = Init("weights", path="w", on_meta=False)
    assert resolve_init(given) is given


@pytest.mark.parametrize("value", [3, "", ["reset"]])
def test_anything_else_is_refused_with_what_init_takes(value):
    with pytest.raises(ConfigError, match="init must be 'reset', a function"):
        resolve_init(value)


@pytest.mark.parametrize("init, init_from, expected", [
    (None, None, None),
    ("eager", None, None),
    ("meta", None, Init("reset")),
    (None, "w", Init("weights", path="w")),
    ("meta", "w", Init("weights", path="w")),
    ("eager", "w", Init("weights", path="w", on_meta=False)),
])
def test_the_two_flags_read_together(init, init_from, expected):
    assert init_from_flags(init, init_from) == expected


def test_an_init_holds_what_its_kind_needs_and_nothing_else():
    with pytest.raises(ValueError, match="kind must be one of"):
        Init("zeros")
    with pytest.raises(ValueError, match="a path exactly"):
        Init("weights")
    with pytest.raises(ValueError, match="a function exactly"):
        Init("reset", function=first_values)


def test_it_says_what_the_user_gave():
    assert Init("function", function=first_values).given == "first_values"
    assert Init("weights", path="w").describe() == "weights from w"
    assert Init("reset").given == "reset"


def test_it_loads_without_pytorch():
    code = "import sys, pipetrain.initialiser; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
