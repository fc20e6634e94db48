"""Reading checkpoints: a step directory opened only when its manifest vouches for every file.

Nothing outside the step directory is read, nothing through a symbolic link, every read is bounded
by the size the manifest gives, and files load in torch's safe mode only.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from pipetrain.errors import option
from pipetrain.runtime.checkpoint_layout import FORMAT, MANIFEST, MANIFEST_LIMIT, plain_name
from pipetrain.runtime.errors import CheckpointError

__all__ = ["Checkpoint", "open_checkpoint", "first_line"]


@dataclass(frozen=True)
class Checkpoint:
    """A complete, verified checkpoint: its directory, step, metadata and file records.

    Layout (the files are named by their writer; the training runtime writes one per rank,
    ``rank-N.pt``, holding the state of every stage replica the rank runs)::

        DIR/step-000120/rank-0.pt         torch.save of rank 0's state (weights, optimizer, versions...)
        DIR/step-000120/rank-1.pt
        DIR/step-000120/manifest.json     {"format", "step", "files": [{name, size, sha256}], "meta"}

    Every file is written under a temporary name, flushed, fsynced and renamed, then the directory is
    fsynced; the manifest comes last, so a step directory without a manifest is not a checkpoint (the
    run stopped while writing it). Loading checks every file's size and SHA-256 against the manifest
    before reading anything, so a truncated or corrupted checkpoint is refused (when named) or skipped
    with a warning in favour of the previous complete one (when looking for the latest), never
    half-loaded. The manifest's ``meta`` (model spec, schedule, stages, replicas, a config fingerprint)
    lets :func:`~pipetrain.runtime.checkpoint.check_compatible` refuse a resume into a different run, naming the difference.

    With several ranks, :func:`~pipetrain.runtime.checkpoint_write.save_distributed` is called by every rank at the same step: each writes
    its own file(s) and publishes their size and hash through the run's store; rank 0 waits for all of
    them (with a timeout), writes the manifest, and tells the others it committed. The directory must be
    one that every rank sees (one machine, or a shared file system).
    """

    path: Path
    step: int
    meta: dict[str, Any]
    files: dict[str, dict[str, Any]]

    def load(self, name: str, map_location: Any = "cpu") -> Any:
        """The state saved as ``name``, after checking its size and SHA-256 once more.

        Read onto the CPU by default, wherever its tensors were when it was written (a file from a
        GPU loads on a machine without one); the stages move their state to their own device when
        they restore. Tensors that cannot be mapped anywhere (PyTorch's 'meta' device: saved
        without values) are refused with a :class:`CheckpointError` that says where they are.

        Always in torch.load's safe mode (``weights_only=True``), which unpickles nothing but
        tensors and plain containers of numbers and strings: a checkpoint directory is input, and
        a pickle could run code. Save RNG states with :func:`~pipetrain.runtime.checkpoint.capture_rng`, not as numpy objects.
        """
        record = self.files.get(name)
        if record is None:
            raise CheckpointError(
                f"checkpoint {self.path} has no file {name!r}; it holds {sorted(self.files)}"
            )
        data = _read_verified(self.path, record)
        try:
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"checkpoint {self.path}: {name} holds objects other than tensors and plain data, which pipetrain "
                f"does not load ({_refused_object(error)}); it was not written by pipetrain"
            ) from None
        except RuntimeError as error:
            text = first_line(error)
            advice = ("read it with map_location='cpu' (the default) and move its tensors to the device that uses "
                      "them" if "device" in text.lower() or "map_location" in text else
                      "it was not written by pipetrain, or it is damaged")
            raise CheckpointError(
                f"checkpoint {self.path}: {name} cannot be read with map_location={map_location!r} here ({text}); "
                + advice
            ) from None
        empty = _without_data(state)
        if empty:
            shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
            raise CheckpointError(
                f"checkpoint {self.path}: {name} holds tensors without data, on PyTorch's 'meta' device ({shown}), "
                "which cannot be mapped onto this run's device or any other: it was written from weights that were "
                "never materialised (a model built under torch.device('meta')). Resume from another checkpoint, or "
                f"start afresh with another {option('checkpoint_dir')}"
            )
        return state


def _refused_object(error: BaseException) -> str:
    """What torch's safe loader refused, without torch's advice to turn safe loading off ("will
    likely succeed") or to allow-list the object: a checkpoint directory is input."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"it refers to {found.group(1)}" if found else "torch's safe loader refused it"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _without_data(value: Any, where: str = "") -> list[str]:
    """Where in ``value`` (nested dicts, lists, tuples) a tensor lies on the 'meta' device: saved
    without its values, so no ``map_location`` gives them back."""
    if isinstance(value, torch.Tensor):
        return [where or "the state itself"] if value.is_meta else []
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        found += _without_data(item, f"{where}/{key}" if where else str(key))
    return found


def _open_plain(d: Path, name: str) -> int:
    """A read-only descriptor of regular file ``d/name``: opened without following a symbolic link
    and without blocking (a FIFO would block the open until a writer came), then checked to be a
    regular file (not a FIFO, a device such as /dev/zero, a socket or a directory)."""
    try:
        fd = os.open(d / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint {d}: {name} is a symbolic link; pipetrain reads checkpoint files only "
                                  "in the checkpoint's own directory, never through links") from None
        raise CheckpointError(f"checkpoint {d} is incomplete: cannot read {name} ({error.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise CheckpointError(f"checkpoint {d} is damaged: {name} is {kind}, not a checkpoint file")
    return fd


def _read_plain(d: Path, name: str, size: int | None, limit: int) -> bytes:
    """The bytes of regular file ``d/name`` (see :func:`_open_plain`): exactly ``size`` of them,
    or, with ``size`` None, at most ``limit``; a file of another size is refused before reading."""
    fd = _open_plain(d, name)
    try:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise CheckpointError(
                f"checkpoint {d} is damaged: {name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
            )
        if actual > limit:
            raise CheckpointError(f"checkpoint {d} is damaged: {name} has {actual} bytes, more than a {name} holds")
        chunks, left = [], actual
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as error:
        raise CheckpointError(f"checkpoint {d} is incomplete: cannot read {name} ({error.strerror})") from None
    finally:
        os.close(fd)
    if len(data) != actual:
        raise CheckpointError(f"checkpoint {d} is damaged: {name} changed size while being read")
    return data


def _read_verified(d: Path, record: Mapping[str, Any]) -> bytes:
    name = record["name"]
    data = _read_plain(d, name, record["size"], record["size"])
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise CheckpointError(f"checkpoint {d} is damaged: {name} does not match its SHA-256")
    return data


def _records(d: Path, files: object) -> dict[str, dict[str, Any]]:
    """The manifest's file records by name, each checked before anything is opened: a plain file
    name of the checkpoint's own directory (no path, no ``..``), a size, a SHA-256."""
    if not isinstance(files, list):
        raise CheckpointError(f"checkpoint {d} has an unreadable {MANIFEST}: 'files' is not a list")
    if not files:
        raise CheckpointError(
            f"{d} is not a complete checkpoint: its {MANIFEST} lists no files (it was not written by pipetrain)"
        )
    records: dict[str, dict[str, Any]] = {}
    for record in files:
        name = record.get("name") if isinstance(record, dict) else None
        if not plain_name(name):
            raise CheckpointError(
                f"checkpoint {d} is damaged: its {MANIFEST} names {name!r}, which is not a plain file name of the "
                "checkpoint's own directory; pipetrain reads nothing outside it"
            )
        size, sha = record.get("size"), record.get("sha256")
        if (not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str)
                or not re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise CheckpointError(f"checkpoint {d} has an unreadable {MANIFEST}: the record of {name} needs a size "
                                  "and a SHA-256")
        if name in records:
            raise CheckpointError(f"checkpoint {d} is damaged: its {MANIFEST} lists {name} twice")
        records[name] = dict(record)
    return records


def _refuse_link(d: Path) -> None:
    if d.is_symlink():
        raise CheckpointError(
            f"{d} is a symbolic link: pipetrain reads and deletes checkpoints only in the step directories themselves, "
            "never through links; name the directory it points to"
        )


def open_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> Checkpoint:
    """The checkpoint in step directory ``path`` (or its manifest file), verified.

    Raises :class:`CheckpointError` if it has no manifest (not a checkpoint: the run stopped
    while writing it), or a file is missing, truncated or does not match its checksum. With
    ``verify=False`` only presence and sizes are checked. Nothing outside the step directory is
    read: the manifest may only name plain files of it, and neither the directory nor any of its
    files may be a symbolic link; every read is bounded by the size the manifest gives.
    """
    d = Path(path)
    if d.name == MANIFEST:
        d = d.parent
    _refuse_link(d)
    if not d.is_dir():
        raise CheckpointError(f"no checkpoint at {d}: not a directory")
    if not os.path.lexists(d / MANIFEST):
        raise CheckpointError(
            f"{d} is not a complete checkpoint: it has no {MANIFEST} (the run stopped while saving "
            "it, or this is not a checkpoint directory)"
        )
    try:
        manifest = json.loads(_read_plain(d, MANIFEST, None, MANIFEST_LIMIT))
        step = int(manifest["step"])
        files = manifest["files"]
        meta = dict(manifest.get("meta", {}))
        fmt = int(manifest.get("format", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint {d} has an unreadable {MANIFEST}: {first_line(error)}") from None
    if fmt > FORMAT:
        raise CheckpointError(
            f"checkpoint {d} has format {fmt}, newer than this pipetrain understands ({FORMAT}): upgrade pipetrain"
        )
    records = _records(d, files)
    for record in records.values():
        if verify:
            _read_verified(d, record)
        else:
            fd = _open_plain(d, record["name"])
            size = os.fstat(fd).st_size
            os.close(fd)
            if size != record["size"]:
                raise CheckpointError(f"checkpoint {d} is incomplete or damaged: {record['name']} has {size} bytes, "
                                      f"the manifest says {record['size']}")
    return Checkpoint(path=d, step=step, meta=meta, files=records)

