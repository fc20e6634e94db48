"""Comma-separated option values (``--balance 2,2,1``, ``--lr-scale 0.5,1``) as argparse types."""

from __future__ import annotations

import argparse
from typing import Callable


def number_list(cast: Callable[[str], float] | type[int], example: str) -> Callable[[str], list]:
    """An argparse ``type`` parsing ``a,b,...`` with ``cast``; the error shows ``example``."""
    noun = "integers" if cast is int else "numbers"

    def parse(text: str) -> list:
        try:
            return [cast(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, e.g. {example}; got {text!r}") from None

    return parse
