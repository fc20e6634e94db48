"""The Python API's keywords are checked against the types their signature shows
(pipetrain.training.api_types): a value of another type is an ArgumentError, a ConfigError and a
TypeError at once, naming the keyword, what it takes and what it got."""

from __future__ import annotations

import pathlib

import pytest

from pipetrain.errors import ArgumentError, ConfigError
from pipetrain.training.api_types import checked_value


def _check(value, annotation):
    return checked_value("steps", "steps", value, annotation, "fit()")


@pytest.mark.parametrize("value, annotation", [
    (3, "int | None"), (None, "int | None"), (2.5, "float"), (2, "float"), ("sgd", "str | type | OptimizerFactory"),
    (len, "str | Callable[[nn.Module, str], Any] | None"), ([1, 2], "Sequence[int] | None"), ((), "Sequence[int]"),
    (["a", int], "Sequence[str | type]"), ({"k": 1}, "dict[str, Any] | None"), (True, "bool | str"),
    (object(), "Any"), (object(), "SomethingElse"),
])
def test_values_of_the_annotated_type_pass_as_they_are(value, annotation):
    assert _check(value, annotation) is value


@pytest.mark.parametrize("value, annotation", [
    ("3", "int | None"), (True, "int"), (False, "float"), ("a", "Sequence[str] | None"), ([1, "2"], "Sequence[int]"),
    ([1], "dict[str, Any] | None"), ("yes", "bool"), (3, "str | Callable[[Any], Any] | None"), (3, "type"),
])
def test_a_value_of_another_type_is_refused_naming_what_the_keyword_takes(value, annotation):
    with pytest.raises(ArgumentError) as caught:
        _check(value, annotation)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, TypeError)
    assert str(caught.value) == f"fit(): steps takes {annotation}, not {type(value).__name__} {value!r}"
    assert caught.value.options == ("steps",)


def test_a_path_object_is_taken_as_its_text_where_a_str_is_taken():
    assert _check(pathlib.Path("out") / "m.pt", "str | None") == "out/m.pt"


def test_a_long_value_is_cut_in_the_message():
    with pytest.raises(ArgumentError, match=r"not str '(x){36}\.\.\.$"):
        _check("x" * 100, "int")
