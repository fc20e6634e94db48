"""The `pipetrain` command: one sub-command per module of `pipetrain.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so `pipetrain schedule` starts without loading
PyTorch. A :class:`~pipetrain.errors.PipetrainError` is printed as one line on stderr, with its exit status (2 for bad
input, 3 for a lost or timed-out peer, 128+N for a worker killed by signal N).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from pipetrain.errors import PipetrainError, naming_options_as

__all__ = ["main"]

# command name -> (module, one-line help). Help text lives here so that `pipetrain --help` does
# not import every command module (and PyTorch with them).
COMMANDS: dict[str, tuple[str, str]] = {
    "schedule": ("pipetrain.commands.schedule", "generate, validate, simulate and draw a schedule"),
    "train": ("pipetrain.commands.train", "train a model with a pipeline schedule (emulated or distributed)"),
    "profile": ("pipetrain.commands.profile", "measure per-layer times and sizes of a model"),
    "plan": ("pipetrain.commands.plan", "partition a profiled model into stages and replicas"),
    "pb": ("pipetrain.commands.pb", "Pipelined Backpropagation study: PB, SC, LWP against batch-size-1 SGD"),
    "calibrate": ("pipetrain.commands.calibrate", "measure message, all-reduce and per-action costs here for the simulator"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors exit with status 2, as argparse's do, in one line that points at ``--help``
    instead of argparse's usage block (two dozen lines for `pipetrain train`)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _build_parser(selected: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser, and the selected command's own (its options only, PyTorch not imported)."""
    parser = _Parser(prog="pipetrain", description="Pipeline-parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module_name).add_arguments(command_parser)
            chosen = command_parser
    return parser, chosen


def _unrecognized(command: argparse.ArgumentParser, extras: list[str]) -> None:
    """Refuse options the command does not have, with its usage and the closest option names."""
    import difflib

    known = [option for action in command._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"did you mean {close[0]} for {name}?")
    command.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; {' '.join(hints)}" if hints else ""))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    if selected not in COMMANDS:
        selected = None
    parser, command = _build_parser(selected)
    args, extras = parser.parse_known_args(argv)
    if extras:
        if command is None:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        _unrecognized(command, extras)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    with naming_options_as("flag"):  # a message's options as flags, here and in the workers started
        try:
            return int(module.run(args) or 0)
        except PipetrainError as error:  # 2: bad input; 3: a lost or timed-out peer; 128+N: a worker killed by signal N
            print(f"pipetrain {args.command}: error: {error}", file=sys.stderr)
            import gc

            gc.freeze()  # the exit's last collection of a prepared run's objects took 1-3 s after the message
            return error.exit_status
        except KeyboardInterrupt:
            print(f"pipetrain {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
