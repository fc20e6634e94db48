"""The run's schedule set-up (`pipetrain.training.scheduling`): microbatches per update resolved and
checked in one place, and the schedule built from units per update and updates for every schedule."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.schedule import build
from pipetrain.schedule.presets import build_updates
from pipetrain.training.config import TrainConfig
from pipetrain.training.scheduling import resolved_microbatches, run_schedule
from pipetrain.training.validate import check_config


@pytest.mark.parametrize("schedule, batch_size, given, expected", [
    ("1f1b", 32, None, 4), ("1f1b", 2, None, 2), ("gpipe", 32, 6, 6),
    ("pipedream", 32, None, 1), ("pb", 32, None, 1), ("pipedream", 32, 3, 3), ("2bw", 32, None, 4),
])
def test_microbatches_get_their_default_here(schedule, batch_size, given, expected):
    config = TrainConfig(schedule=schedule, batch_size=batch_size, microbatches=given)
    assert resolved_microbatches(config, schedule) == expected


def test_microbatches_are_checked_once_with_one_message_for_every_source():
    """A plan's value (which no option check saw) is refused with the words of --microbatches' own
    check, the one that check_config runs on a given value."""
    with pytest.raises(ConfigError) as given:
        check_config(TrainConfig(microbatches=0))
    with pytest.raises(ConfigError) as resolved:
        resolved_microbatches(TrainConfig(microbatches=0), "1f1b")
    assert str(resolved.value) == str(given.value)
    assert "must be at least 1, got 0" in str(resolved.value)


def _programs(schedule):
    return [list(map(str, program)) for program in schedule.programs]


@pytest.mark.parametrize("name", ["pipedream", "pb"])
def test_an_asynchronous_schedule_counts_units_and_updates_as_a_synchronous_one(name):
    # 5 updates of 2 microbatches: build() itself counts pipedream's units as all 10, one update per 2
    built = build_updates(name, 3, 2, 5)
    assert _programs(built) == _programs(build(name, 3, 10, update_every=2))
    assert built.microbatches == 10


def test_a_synchronous_schedule_gets_its_steps():
    built = build_updates("1f1b", 3, 4, 2)
    assert _programs(built) == _programs(build("1f1b", 3, 4, steps=2))
    assert (built.microbatches, built.steps) == (4, 2)


def test_the_run_schedule_drains_where_asked():
    config = TrainConfig(schedule="pipedream")
    whole = run_schedule(config, "pipedream", 2, 1, 6, None, ())
    drained = run_schedule(config, "pipedream", 2, 1, 6, None, (3,))
    assert _programs(whole) != _programs(drained)
    assert drained.microbatches == whole.microbatches == 6
