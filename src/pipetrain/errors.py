"""Errors a user can cause, each with a message that says what to change."""

from __future__ import annotations

__all__ = ["PipetrainError", "ScheduleError", "DeadlockError", "ConfigError"]


class PipetrainError(Exception):
    """Base class of every error caused by user input.

    The command-line tool prints the message without a traceback and exits with status 2, so the
    message must stand on its own: say what was wrong and what would work instead.
    """


class ScheduleError(PipetrainError):
    """A schedule is malformed, impossible for its parameters, or fails validation."""


class DeadlockError(ScheduleError):
    """A dry run of all ranks got stuck: the message names the ranks and the actions they wait on."""


class ConfigError(PipetrainError):
    """A configuration value (option, spec, model, data) is invalid."""
