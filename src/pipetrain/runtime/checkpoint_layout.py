"""A checkpoint on disk: ``DIR/step-N/`` holding its files and the manifest that vouches for them.

The names every checkpoint module shares: the step directory of a step, a stage's file name, which
names a checkpoint may hold, and the step directories under a checkpoint root (see
:mod:`pipetrain.runtime.checkpoint` for which module does what with them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MANIFEST", "FORMAT", "MANIFEST_LIMIT", "STEP_DIR", "step_dir", "stage_file", "plain_name",
           "step_entries", "list_checkpoints"]

MANIFEST = "manifest.json"
FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
#: The most bytes a manifest may hold: a real one lists a few files and a small ``meta``; a
#: manifest is read before anything vouches for it, so nothing larger is read.
MANIFEST_LIMIT = 16 * 2**20


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """``DIR/step-000120`` for step 120."""
    return Path(directory) / f"step-{step:06d}"


def stage_file(stage: int) -> str:
    """The conventional file name of a stage's state: ``stage-3.pt``."""
    return f"stage-{stage}.pt"


def plain_name(name: object) -> bool:
    """Whether ``name`` names a file of a checkpoint's own directory: no path, no link upwards,
    not hidden (temporary files are), not the manifest."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..", MANIFEST) and not name.startswith(".")
            and not any(c in name for c in "/\\\0"))


def step_entries(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step-N`` entry under ``directory``, links included, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), child) for child in root.iterdir() if (m := STEP_DIR.match(child.name)))


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``directory`` (complete or not), oldest first; a
    symbolic link named ``step-N`` is not one (see :func:`pipetrain.runtime.checkpoint.find_latest`)."""
    return [(step, path) for step, path in step_entries(directory) if not path.is_symlink() and path.is_dir()]
