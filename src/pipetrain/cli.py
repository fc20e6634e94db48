"""The `pipetrain` command: one sub-command per module of `pipetrain.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so `pipetrain schedule` starts without loading
PyTorch. A :class:`~pipetrain.errors.PipetrainError` is printed as one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from pipetrain.errors import PipetrainError

__all__ = ["main"]

# command name -> (module, one-line help). Help text lives here so that `pipetrain --help` does
# not import every command module (and PyTorch with them).
COMMANDS: dict[str, tuple[str, str]] = {
    "schedule": ("pipetrain.commands.schedule", "generate, validate, simulate and draw a schedule"),
    "train": ("pipetrain.commands.train", "train a model with a pipeline schedule (emulated or distributed)"),
    "profile": ("pipetrain.commands.profile", "measure per-layer times and sizes of a model"),
    "plan": ("pipetrain.commands.plan", "partition a profiled model into stages and replicas"),
    "pb": ("pipetrain.commands.pb", "Pipelined Backpropagation study: PB, SC, LWP against batch-size-1 SGD"),
}


class _Parser(argparse.ArgumentParser):
    """argparse exits with status 2 on usage errors already; keep its message on one line."""


def _build_parser(selected: str | None) -> argparse.ArgumentParser:
    parser = _Parser(prog="pipetrain", description="Pipeline-parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    if selected not in COMMANDS:
        selected = None
    parser = _build_parser(selected)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except PipetrainError as error:
        print(f"pipetrain {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipetrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
