"""Plain text shared by the commands: comma-separated option values (``--balance 2,2,1``) as
argparse types, and aligned tables."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence


def number_list(cast: Callable[[str], float] | type[int], example: str) -> Callable[[str], list]:
    """An argparse ``type`` parsing ``a,b,...`` with ``cast``; the error shows ``example``."""
    noun = "integers" if cast is int else "numbers"

    def parse(text: str) -> list:
        try:
            return [cast(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, e.g. {example}; got {text!r}") from None

    return parse


def aligned(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Table rows as lines, each column padded to its widest cell (two spaces between columns)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
