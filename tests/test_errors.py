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

