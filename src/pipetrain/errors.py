"""Errors a user can cause, each with a message that says what to change."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator, Mapping

__all__ = ["PipetrainError", "ScheduleError", "DeadlockError", "ConfigError", "ArgumentError", "StageError", "NonFiniteError",
           "ModelError", "DataWorkerLost", "option", "options_named", "name_options", "naming_options_as",
           "written"]

# -- options named in messages -----------------------------------------------------------------
#
# A message names an option by its field (``option("batch_size")``); it is written out when the
# error is printed, as the command line calls the option (``--batch-size``) when the command line
# runs (:func:`naming_options_as`, inherited by the worker processes it starts) and as the Python
# API calls it (``batch_size``) otherwise. The names come from the options' declarations
# (:mod:`pipetrain.training.options`), which hand them here (:func:`name_options`).

_MARK, _VALUE, _CLI = "\x1f", "\x1e", "\x1d"
_NAME = r"([A-Za-z_][A-Za-z0-9_]*)"
_FIELD = re.compile(_MARK + _NAME + "(?:" + _CLI + "(--[A-Za-z0-9-]+))?(?:" + _VALUE + "([^\x1d\x1e\x1f]*)" + _VALUE
                    + "([^\x1d\x1e\x1f]*))?" + _MARK)
_STYLE = "PIPETRAIN_OPTION_NAMES"  # flag or keyword: how this process and its workers name options
_NAMES: dict[str, dict[str, str]] = {"flag": {}, "keyword": {}}
_NO_VALUE = object()


def option(field: str, value: Any = _NO_VALUE, *, cli: str | None = None, flag: str | None = None) -> str:
    """The option ``field`` in a message: ``--field-name`` on the command line, its keyword in
    Python. With ``value``, the option set to it, as the user would write it there:
    ``--steps 12`` (a list comma-separated: ``--balance 2,3``) or ``steps=12``. Where the command
    line says it otherwise: ``cli``, its text of the value (``--recompute auto`` for
    ``recompute=True``), and ``flag``, its flag where the field has several (``init='reset'`` is
    ``--init meta`` while ``init='DIR'`` is ``--init-from DIR``:
    ``option("init", "reset", flag="--init", cli="meta")``)."""
    head = field if flag is None else f"{field}{_CLI}{flag}"
    if value is _NO_VALUE:
        return f"{_MARK}{head}{_MARK}"
    if cli is None:
        cli = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    python = repr(list(value) if isinstance(value, tuple) else value)
    return f"{_MARK}{head}{_VALUE}{_clean(cli)}{_VALUE}{_clean(python)}{_MARK}"


def _clean(text: str) -> str:
    return text.replace(_MARK, "").replace(_VALUE, "").replace(_CLI, "")


def options_named(text: str) -> tuple[str, ...]:
    """The fields a message names with :func:`option`, in order."""
    return tuple(match[1] for match in _FIELD.finditer(text))


def name_options(flags: Mapping[str, str], keywords: Mapping[str, str]) -> None:
    """Declare what the command line (``flags``) and Python (``keywords``) call each field."""
    _NAMES["flag"].update(flags)
    _NAMES["keyword"].update(keywords)


@contextlib.contextmanager
def naming_options_as(style: str) -> Iterator[None]:
    """Write the options of every message as ``style`` (``"flag"`` or ``"keyword"``) here and in the
    processes started meanwhile."""
    if style not in _NAMES:
        raise ValueError(f"style must be flag or keyword, not {style!r}")
    before = os.environ.get(_STYLE)
    os.environ[_STYLE] = style
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_STYLE, None)
        else:
            os.environ[_STYLE] = before


def written(text: str) -> str:
    """``text`` with the options it names (:func:`option`) written as this process names them: for
    a line that is printed rather than raised (a :class:`PipetrainError` writes its own)."""
    style = os.environ.get(_STYLE, "keyword")
    names = _NAMES.get(style, _NAMES["keyword"])

    def one(match: re.Match) -> str:
        field, given_flag, cli, python = match[1], match[2], match[3], match[4]
        if style == "flag":
            flag = given_flag or names.get(field) or "--" + field.replace("_", "-")
            return flag if cli is None else f"{flag} {cli}"
        keyword = names.get(field) or field
        return keyword if python is None else f"{keyword}={python}"

    return _FIELD.sub(one, text)


class PipetrainError(Exception):
    """Base class of every error caused by user input.

    The command-line tool prints the message without a traceback and exits with ``exit_status``
    (2; 3 for a lost or timed-out peer, see :mod:`pipetrain.runtime.errors`), so the message must
    stand on its own: say what was wrong and what would work instead.
    """

    exit_status = 2

    def __str__(self) -> str:
        return written(super().__str__())

    @property
    def options(self) -> tuple[str, ...]:
        """The fields of the options the message names (see :func:`option`)."""
        return options_named(super().__str__())


class ScheduleError(PipetrainError):
    """A schedule is malformed, impossible for its parameters, or fails validation."""


class DeadlockError(ScheduleError):
    """A dry run of all ranks got stuck: the message names the ranks and the actions they wait on."""


class ConfigError(PipetrainError):
    """A configuration value (option, spec, model, data) is invalid."""


class ArgumentError(ConfigError, TypeError):
    """A Python API call given a keyword it does not take, or a value of a type it does not take:
    a :class:`ConfigError`, so that one ``except`` catches every set-up error, and a ``TypeError``,
    as Python's own for such a call."""


class StageError(PipetrainError):
    """Something went wrong in one stage's computation of one microbatch.

    ``stage`` is where it was seen; ``step`` the update (counted from 1) when known, else
    ``microbatch`` names the unit (the executor that runs the schedule knows which update that
    unit belongs to and says so in the message it re-raises, :func:`pipetrain.execution.failures.located`).
    """

    def __init__(self, message: str, *, stage: int | None = None, step: int | None = None,
                 microbatch: int | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.stage, self.step, self.microbatch, self.rank = stage, step, microbatch, rank

    def __reduce__(self):  # keyword attributes survive pickling (results of worker processes)
        return (_rebuild, (type(self), str(self), self.stage, self.step, self.microbatch, self.rank))


def _rebuild(kind: type, message: str, stage, step, microbatch, rank) -> StageError:
    return kind(message, stage=stage, step=step, microbatch=microbatch, rank=rank)


class NonFiniteError(StageError):
    """A loss, gradient or weight became NaN or infinite: training stopped before applying it."""


class ModelError(StageError):
    """The user's model or loss raised (named with its type and the file and line it was raised
    at), or gave what training cannot use, such as a loss that is not one number."""


class DataWorkerLost(PipetrainError):
    """A DataLoader worker process reading this rank's batches died: killed by a signal (the
    kernel's out-of-memory killer picks such a process first) or gone without a word. A fault,
    not bad data: the exit status is 128+N for signal N (3 when torch does not say which), so
    ``--max-restarts`` starts the run again."""

    def __init__(self, message: str, signal: int | None = None) -> None:
        super().__init__(message)
        self.signal = signal
        self.exit_status = 128 + signal if signal else 3

    def __reduce__(self):
        return (DataWorkerLost, (str(self), self.signal))
