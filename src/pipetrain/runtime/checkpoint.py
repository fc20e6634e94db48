"""Atomic, verified checkpoints: one file per rank (or stage), and a manifest written last that vouches for them.

This module is the face of checkpoint files (import the names below from here) and chooses among
them; the work is split by concept:

=============================  ==================================================================
file                           owns
=============================  ==================================================================
``runtime/checkpoint_layout``  the layout on disk: ``step-N`` directories, file names, the manifest
``runtime/checkpoint_write``   writing: atomic files; a checkpoint from one process or every rank
``runtime/checkpoint_read``    reading: :class:`Checkpoint`, opened only where its manifest vouches
``runtime/checkpoint``         this module: the newest complete checkpoint, ``--resume``, pruning,
                               the fingerprint and the check that a resume matches, RNG states
``runtime/rank_runner``        a rank's file: its stages' states and RNG (``RankRunner.snapshot``)
``execution/snapshot``         a stage's state (versions, optimizer, microbatches in flight)
``training/checkpoints``       when a run saves, where it resumes from, what the manifest records
``training/recut``             resuming a synchronous checkpoint on another cut of the model
=============================  ==================================================================

docs/design.md (section 2, "Checkpoints") draws the same table.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from pipetrain.runtime.checkpoint_layout import MANIFEST, STEP_DIR, list_checkpoints, stage_file, step_dir, step_entries
from pipetrain.runtime.checkpoint_read import Checkpoint, open_checkpoint
from pipetrain.runtime.checkpoint_write import (check_step_dir, fsync_dir, save_checkpoint, save_distributed,
                                                save_shard, save_torch_file, write_manifest)
from pipetrain.runtime.errors import CheckpointError, CheckpointMismatchError

__all__ = [
    # the layout, writing and reading (from the modules above: one place to import them from)
    "MANIFEST",
    "Checkpoint",
    "step_dir",
    "stage_file",
    "save_shard",
    "check_step_dir",
    "save_torch_file",
    "write_manifest",
    "save_checkpoint",
    "save_distributed",
    "open_checkpoint",
    "list_checkpoints",
    # this module's own
    "find_latest",
    "resolve",
    "prune",
    "check_compatible",
    "fingerprint",
    "capture_rng",
    "restore_rng",
]


def find_latest(
    directory: str | os.PathLike[str], *, verify: bool = True, skipped: list[str] | None = None
) -> Checkpoint | None:
    """The newest complete checkpoint under ``directory``, or None. Newer step directories that are
    incomplete or damaged, and links named ``step-N``, are skipped with a warning that says why
    (appended to ``skipped`` instead, when given: a run that resumes by itself says so in its
    own words)."""
    for _, path in reversed(step_entries(directory)):
        if not path.is_symlink() and not path.is_dir():
            continue
        try:
            return open_checkpoint(path, verify=verify)
        except CheckpointError as error:
            if skipped is not None:
                skipped.append(str(error))
            else:
                warnings.warn(f"{error}; skipping it for an older checkpoint", stacklevel=2)
    return None


def resolve(path: str | os.PathLike[str]) -> Checkpoint:
    """What ``--resume PATH`` means: a step directory (or its manifest) is loaded as named, and
    refused if broken; a checkpoint root directory gives its newest complete checkpoint."""
    p = Path(path)
    if p.name == MANIFEST or STEP_DIR.match(p.name) or (p / MANIFEST).exists():
        return open_checkpoint(p)
    if not p.is_dir():
        raise CheckpointError(f"cannot resume from {p}: no such directory")
    latest = find_latest(p)
    if latest is None:
        raise CheckpointError(f"cannot resume from {p}: it holds no complete checkpoint (step-N directory with a {MANIFEST})")
    return latest


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete step directories
    older than the newest complete one (newer ones may still be being written). Returns the
    deleted paths. The manifest goes first, so an interrupted deletion leaves no false checkpoint.
    A symbolic link named ``step-N`` is left alone, and so is whatever it points to."""
    if keep < 1:
        raise CheckpointError(f"keep at least one checkpoint, got keep={keep}")
    entries = list_checkpoints(directory)
    complete = []
    for step, path in entries:
        try:
            open_checkpoint(path, verify=False)
            complete.append(step)
        except CheckpointError:
            pass
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    removed = []
    for step, path in entries:
        if step in kept or step > newest or path.is_symlink():  # never through a link (it may have appeared since)
            continue
        (path / MANIFEST).unlink(missing_ok=True)
        fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


_NOT_SET = "<not recorded>"


def check_compatible(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    keys: Iterable[str] | None = None,
    *,
    where: str = "the checkpoint",
) -> None:
    """Refuse to resume a run whose ``current`` metadata differs from the ``saved`` one on
    ``keys`` (default: every key of ``current``), naming each difference."""
    diffs = []
    for key in (keys if keys is not None else current.keys()):
        old = saved.get(key, _NOT_SET)
        new = current.get(key, _NOT_SET)
        if _canonical(old) != _canonical(new):
            diffs.append(f"{key}: {old!r} in {where}, {new!r} in this run")
    if diffs:
        raise CheckpointMismatchError(
            f"cannot resume from {where}: it was written by a different run ("
            + "; ".join(diffs)
            + "). Resume with the same settings, or start from scratch with another checkpoint directory"
        )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def fingerprint(config: Mapping[str, Any]) -> str:
    """A short stable hash of a configuration (JSON with sorted keys): equal configs, equal prints."""
    return hashlib.sha256(_canonical(config).encode()).hexdigest()[:16]


def capture_rng() -> dict[str, Any]:
    """The state of every random number generator a run uses (torch CPU and CUDA, Python's random,
    numpy's global one), in a form that loads with ``weights_only=True``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():  # GPUs this machine lacks: their states are dropped
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
