"""An error names an option by its field; it is written as the flag on the command line and as
the keyword in Python (pipetrain.errors.option)."""

from __future__ import annotations

import os
import pickle

from pipetrain.errors import ConfigError, naming_options_as, option


def test_an_option_is_written_as_the_keyword_by_default_and_as_the_flag_on_the_command_line():
    import pipetrain.training.config  # noqa: F401  (it declares the names)

    error = ConfigError(f"{option('test_data')} and {option('lr_schedule')} and {option('shuffle')}")
    assert str(error) == "eval_data and lr_scheduler and shuffle"
    assert error.options == ("test_data", "lr_schedule", "shuffle")
    with naming_options_as("flag"):
        assert str(error) == "--test-data and --lr-schedule and --no-shuffle"
        assert os.environ["PIPETRAIN_OPTION_NAMES"] == "flag"  # the workers started meanwhile inherit it
    assert str(error) == "eval_data and lr_scheduler and shuffle"


def test_an_undeclared_field_is_written_from_its_name_and_survives_pickling():
    error = pickle.loads(pickle.dumps(ConfigError(f"{option('no_such_field')} is wrong")))
    assert str(error) == "no_such_field is wrong" and error.options == ("no_such_field",)
    with naming_options_as("flag"):
        assert str(error) == "--no-such-field is wrong"


def test_an_option_with_a_value_is_written_as_the_user_would_set_it():
    import pipetrain.training.config  # noqa: F401

    error = ConfigError(f"use {option('steps', 12)} or {option('balance', [2, 3])} or {option('schedule', '1f1b')}")
    assert str(error) == "use steps=12 or balance=[2, 3] or schedule='1f1b'"
    assert error.options == ("steps", "balance", "schedule")
    with naming_options_as("flag"):
        assert str(error) == "use --steps 12 or --balance 2,3 or --schedule 1f1b"
    where_they_differ = ConfigError(f"try {option('recompute', True, cli='auto')}")
    assert str(where_they_differ) == "try recompute=True"
    with naming_options_as("flag"):
        assert str(where_they_differ) == "try --recompute auto"


def test_an_option_the_command_line_sets_with_another_flag_is_written_as_each_side_sets_it():
    import pipetrain.training.config  # noqa: F401

    error = ConfigError(f"{option('init', 'reset', flag='--init', cli='meta')} cannot give it values")
    directory = ConfigError(f"{option('init', 'w')} holds no weights")
    assert str(error) == "init='reset' cannot give it values" and error.options == ("init",)
    assert str(directory) == "init='w' holds no weights"
    with naming_options_as("flag"):
        assert str(error) == "--init meta cannot give it values"
        assert str(directory) == "--init-from w holds no weights"  # the field's first flag


def _raises(below_the_command_line: bool = False):
    """``(module path, raise statement)`` for every raise of the package (``below_the_command_line``:
    not in commands/ or cli.py)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "src" / "pipetrain"
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if below_the_command_line and (relative.parts[0] == "commands" or relative.name == "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                yield relative, node


def _flags_in_raises_below_the_command_line() -> list[str]:
    """``file:line --flag`` for every flag a raise statement below the command line writes as text
    (a whole command line quoted as an example, ``pipetrain <command> ...``, may name its flags)."""
    import ast
    import re

    flag = re.compile(r"--[a-z][a-z0-9-]+")
    example = re.compile(r"`pipetrain [^`]*`|pipetrain [a-z]+ [^;,)]*")
    found = []
    for relative, node in _raises(below_the_command_line=True):
        text = "".join(sub.value for sub in ast.walk(node.exc)
                       if isinstance(sub, ast.Constant) and isinstance(sub.value, str))
        found += [f"{relative}:{node.lineno} {name}" for name in flag.findall(example.sub("", text))]
    return found


def test_errors_below_the_command_line_name_fields_not_flags():
    """Lower layers name an option with ``option(field)``; only the command line writes it as a flag."""
    assert _flags_in_raises_below_the_command_line() == []


def test_only_pipetrain_errors_carry_option_marks():
    """A message built with ``option()`` is written out by PipetrainError; another exception would
    print its marks."""
    import ast
    import importlib

    import pipetrain.errors as errors

    wrong = []
    for relative, node in _raises():
        if not isinstance(node.exc, ast.Call) or not any(
                isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "option" for sub in ast.walk(node.exc)):
            continue
        module = importlib.import_module(
            "pipetrain." + ".".join(relative.with_suffix("").parts).removesuffix(".__init__"))
        name = getattr(node.exc.func, "id", None) or getattr(node.exc.func, "attr", None)
        kind = getattr(module, name, None) or getattr(errors, name, None)
        if not (isinstance(kind, type) and issubclass(kind, errors.PipetrainError)):
            wrong.append(f"{relative}:{node.lineno} {name}")
    assert wrong == []
