"""Tests of pipetrain.spec: parsing, values, factory import and calls."""

from __future__ import annotations

import itertools
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.spec import Spec, call_factory, format_spec, parse_spec, parse_value, resolve_factory

_counter = itertools.count()


def write_module(tmp_path, monkeypatch, source: str) -> str:
    """A fresh importable module in the current directory; returns its name."""
    name = f"pt_spec_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


def test_builtin_without_options():
    spec = parse_spec("mlp", builtins=["mlp", "resmlp"])
    assert spec == Spec("mlp", None, None, {}, "mlp")
    assert spec.is_builtin and spec.label == "mlp"


def test_builtin_with_options():
    spec = parse_spec("mlp:depth=8,width=1024", builtins=["mlp"])
    assert spec.name == "mlp" and spec.kwargs == {"depth": 8, "width": 1024}


def test_builtin_with_dash_and_trailing_colon_or_comma():
    assert parse_spec("resnet-gn:").kwargs == {}
    assert parse_spec("resnet-gn:depth=2,").kwargs == {"depth": 2}


def test_values():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("-2") == -2
    assert parse_value("0.5") == 0.5 and parse_value("1e-3") == 1e-3
    assert parse_value("True") is True and parse_value("false") is False
    assert parse_value("none") is None
    assert parse_value("64/128/256") == [64, 128, 256]
    assert parse_value("0.1/2") == [0.1, 2]
    assert parse_value("/tmp/data.pt") == "/tmp/data.pt"
    assert parse_value("a/b") == "a/b"
    assert parse_value("group") == "group"


def test_value_may_contain_colon():
    spec = parse_spec("synthetic:path=C:/x,seed=1")
    assert spec.kwargs == {"path": "C:/x", "seed": 1}


def test_factory_specs():
    spec = parse_spec("mypkg.nets:make_net")
    assert (spec.name, spec.module, spec.factory, spec.kwargs) == (None, "mypkg.nets", "make_net", {})
    assert not spec.is_builtin and spec.label == "mypkg.nets:make_net"
    spec = parse_spec("mypkg.nets:make_net:width=64,act=relu", builtins=["mlp"])
    assert spec.kwargs == {"width": 64, "act": "relu"}
    assert parse_spec("mymodule:factory").module == "mymodule"


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["empty"]),
        ("mlp:depth", ["key=value"]),
        ("mlp:depth=1,depth=2", ["twice"]),
        ("mlp:1x=2", ["key=value"]),
        ("mypkg.nets", ["factory name", "mypkg.nets:make_model"]),
        ("my-pkg.x:f", ["module path"]),
        ("mypkg:make-net", ["not a Python name"]),
    ],
)
def test_malformed(text, words):
    with pytest.raises(ConfigError) as info:
        parse_spec(text, builtins=["mlp"])
    for word in words:
        assert word in str(info.value)


def test_unknown_builtin_lists_names_and_suggests():
    with pytest.raises(ConfigError) as info:
        parse_spec("resmpl:depth=4", builtins=["mlp", "resmlp", "resnet-gn"], kind="model")
    message = str(info.value)
    assert "unknown model 'resmpl'" in message
    assert "mlp, resmlp, resnet-gn" in message
    assert "Did you mean 'resmlp'?" in message
    assert isinstance(info.value, PipetrainError)


@given(
    st.dictionaries(
        st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True),
        st.one_of(
            st.integers(-10**6, 10**6),
            st.booleans(),
            st.none(),
            st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True).filter(lambda s: s not in ("true", "false", "none", "inf", "nan")),
            st.lists(st.integers(0, 999), min_size=2, max_size=4),
        ),
        max_size=4,
    ),
    st.booleans(),
)
def test_format_round_trip(kwargs, factory):
    spec = Spec(None, "pkg.mod", "make", kwargs) if factory else Spec("mlp", None, None, kwargs)
    again = parse_spec(format_spec(spec))
    assert (again.name, again.module, again.factory, again.kwargs) == (spec.name, spec.module, spec.factory, kwargs)


def test_resolve_from_current_directory(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, "def make(width=3):\n    return ('made', width)\n")
    factory = resolve_factory(parse_spec(f"{name}:make"))
    assert factory(width=5) == ("made", 5)


def test_missing_module_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_factory(parse_spec("no_such_pkg_xyz.nets:make"), kind="model")
    message = str(info.value)
    assert "'no_such_pkg_xyz.nets'" in message and "ModuleNotFoundError" in message
    assert "current directory" in message and "PYTHONPATH" in message
    assert "\n" not in message


def test_module_failing_at_import(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, "import math\nraise RuntimeError('broken\\nsecond line')\n")
    with pytest.raises(ConfigError) as info:
        resolve_factory(parse_spec(f"{name}:make"))
    assert "RuntimeError: broken" in str(info.value) and "second line" not in str(info.value)


def test_missing_attribute_suggests(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, "def make_net():\n    return 1\n")
    with pytest.raises(ConfigError) as info:
        resolve_factory(parse_spec(f"{name}:make_nte"))
    assert "has no attribute 'make_nte'" in str(info.value) and "'make_net'" in str(info.value)


def test_not_callable(tmp_path, monkeypatch):
    name = write_module(tmp_path, monkeypatch, "thing = 3\n")
    with pytest.raises(ConfigError, match="not a callable"):
        resolve_factory(parse_spec(f"{name}:thing"))


def test_call_factory_unknown_option_names_accepted():
    def make(width=1, depth=2):
        return width, depth

    with pytest.raises(ConfigError) as info:
        call_factory(make, {"widht": 3}, what="model factory m:make")
    message = str(info.value)
    assert "'widht'" in message and "width, depth" in message and "Did you mean 'width'" in message


def test_call_factory_missing_required():
    def make(width):
        return width

    with pytest.raises(ConfigError, match="accepted parameters: width"):
        call_factory(make, {})


def test_call_factory_extras_only_when_accepted():
    def narrow(width=1):
        return {"width": width}

    def wide(width=1, num_classes=None):
        return {"width": width, "num_classes": num_classes}

    def anything(**kwargs):
        return kwargs

    extra = {"num_classes": 10}
    assert call_factory(narrow, {"width": 2}, extra=extra) == {"width": 2}
    assert call_factory(wide, {}, extra=extra) == {"width": 1, "num_classes": 10}
    assert call_factory(anything, {"a": 1}, extra=extra) == {"a": 1, "num_classes": 10}
    assert call_factory(wide, {"num_classes": 3}, extra=extra)["num_classes"] == 3
    with pytest.raises(ConfigError, match=r"accepted: width\."):
        call_factory(wide, {"depth": 3}, extra=extra)


def test_a_factory_that_raises_becomes_one_line_naming_it():
    from pipetrain.errors import ConfigError
    from pipetrain.spec import call_factory

    def factory(width=1):
        raise ZeroDivisionError("width must not be zero\nsecond line")

    def refusing(width=1):
        raise ConfigError("width must be positive")

    with pytest.raises(ConfigError) as caught:
        call_factory(factory, {"width": 0}, what="model factory nets:factory")
    assert str(caught.value).startswith(
        "model factory nets:factory raised ZeroDivisionError: width must not be zero (test_spec.py:")
    assert str(caught.value).endswith(", in factory)") and caught.value.__cause__ is None
    with pytest.raises(ConfigError, match="^width must be positive$"):  # our own errors pass unchanged
        call_factory(refusing, {}, what="model factory nets:refusing")
