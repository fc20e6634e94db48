"""The `pipetrain` command's face: every option's help states its real default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from pipetrain.cli import COMMANDS


def _options(command: str):
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"]


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_help_states_the_default(command):
    missing = []
    for action in _options(command):
        default = action.default
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue  # a flag: off unless given
        text = action.help or ""
        if default is None or default is False:
            if "default" not in text:  # no value: the help says what happens without the option
                missing.append(f"{action.option_strings[0]} (no default: say what happens without it)")
        elif f"default {_shown(default)}" not in text and f"default: {_shown(default)}" not in text:
            missing.append(f"{action.option_strings[0]} (default {_shown(default)!r})")
    assert not missing, f"pipetrain {command}: help without its default: {', '.join(missing)}"


def _errors():
    from pipetrain.errors import ConfigError
    from pipetrain.runtime.errors import JoinError, PeerLostError
    from pipetrain.training.distributed import WorkersFailed

    return [(ConfigError("bad input"), 2), (PeerLostError("rank 1 lost rank 0"), 3),
            (JoinError("rank 1 could not join"), 3), (WorkersFailed("worker rank 1 was killed by SIGKILL", 137), 137)]


@pytest.mark.parametrize("error, status", _errors(), ids=["bad input", "lost peer", "no join", "killed worker"])
def test_the_exit_status_says_what_failed(monkeypatch, capsys, error, status):
    from pipetrain import cli
    from pipetrain.commands import train

    def fail(args):
        raise error

    monkeypatch.setattr(train, "run", fail)
    assert cli.main(["train"]) == status  # 2 bad input, 3 a lost or timed-out peer, 128+N killed by signal N
    assert capsys.readouterr().err.count("\n") == 1  # one line
