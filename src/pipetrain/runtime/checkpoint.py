"""Atomic, verified checkpoints: one file per rank (or stage), and a manifest written last that vouches for them."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import stat
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

import torch

from pipetrain.errors import option
from pipetrain.paths import termination_deferred
from pipetrain.runtime.errors import CheckpointError, CheckpointMismatchError, CheckpointPeerError, PeerTimeoutError

__all__ = [
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
    "find_latest",
    "resolve",
    "prune",
    "check_compatible",
    "fingerprint",
    "capture_rng",
    "restore_rng",
]

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: The most bytes a manifest may hold: a real one lists a few files and a small ``meta``; a
#: manifest is read before anything vouches for it, so nothing larger is read.
MANIFEST_LIMIT = 16 * 2**20


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """``DIR/step-000120`` for step 120."""
    return Path(directory) / f"step-{step:06d}"


def stage_file(stage: int) -> str:
    """The conventional file name of a stage's state: ``stage-3.pt``."""
    return f"stage-{stage}.pt"


class _HashingWriter:
    """A file wrapper that hashes and counts what torch.save writes through it, and keeps the
    ``OSError`` of a failed write: torch.save re-raises it as a RuntimeError that says only
    ``unexpected pos`` (a full disk would read as an internal error)."""

    def __init__(self, f: BinaryIO, hashing: bool = True) -> None:
        self.f = f
        self.sha = hashlib.sha256() if hashing else None
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        if self.sha is not None:
            self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(target: Path, write: Any, *, follow_links: bool = True) -> Any:
    """Write ``target`` through ``write(file)`` under a temporary name, fsync, rename.

    Everything happens in the directory opened once (its descriptor): a temporary name that a link
    replaced meanwhile is never followed. With ``follow_links=False`` the directory itself may not
    be a symbolic link (``OSError`` ELOOP): a checkpoint's step directory. A SIGTERM that arrives
    meanwhile (a launcher stopping its workers) ends the process once the temporary is renamed or
    removed, never in between (:func:`pipetrain.paths.termination_deferred`)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    dir_fd = os.open(target.parent, flags if follow_links else flags | os.O_NOFOLLOW)
    tmp = f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with termination_deferred():
            try:
                with open(tmp, "wb", opener=lambda name, how: os.open(name, how | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                                                                      dir_fd=dir_fd)) as f:
                    value = write(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                raise
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
    finally:
        os.close(dir_fd)
    return value


def _plain_name(name: object) -> bool:
    """Whether ``name`` names a file of a checkpoint's own directory: no path, no link upwards,
    not hidden (temporary files are), not the manifest."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..", MANIFEST) and not name.startswith(".")
            and not any(c in name for c in "/\\\0"))


def _check_name(name: str) -> None:
    if not _plain_name(name):
        raise CheckpointError(f"invalid checkpoint file name {name!r}: use a plain name such as 'stage-0.pt'")


def save_torch_file(
    target: str | os.PathLike[str], obj: Any, *, hashing: bool = True, follow_links: bool = True
) -> tuple[int, str | None]:
    """``torch.save(obj)`` into ``target`` atomically (temporary name, fsync, rename; the temporary
    is removed whatever happens). Returns the size and SHA-256 written (None without ``hashing``).
    ``follow_links=False``: ``target``'s directory may not be a symbolic link (ELOOP).

    A write that fails raises its ``OSError`` (``ENOSPC``: no space left on device), not the
    RuntimeError torch.save turns it into."""

    def write(f: BinaryIO) -> _HashingWriter:
        w = _HashingWriter(f, hashing)
        try:
            torch.save(obj, w)  # type: ignore[arg-type]
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise
        return w

    w = _atomic_write(Path(target), write, follow_links=follow_links)
    return w.size, None if w.sha is None else w.sha.hexdigest()


def save_shard(directory: str | os.PathLike[str], step: int, name: str, state: Any) -> dict[str, Any]:
    """Write ``state`` (anything torch.save takes) as file ``name`` of step ``step``, atomically.

    Returns its manifest record ``{"name", "size", "sha256"}``, computed while writing.
    """
    _check_name(name)
    d = step_dir(directory, step)
    _refuse_writing_through(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        size, sha = save_torch_file(d / name, state, follow_links=False)
    except OSError as error:
        if error.errno == errno.ELOOP:  # it became a link after the check
            _refuse_writing_through(d, always=True)
        raise CheckpointError(f"cannot write checkpoint file {d / name}: {error.strerror or error}") from None
    return {"name": name, "size": size, "sha256": sha}


def check_step_dir(directory: str | os.PathLike[str], step: int) -> None:
    """Refuse now (a run before it trains) the step directory a checkpoint of ``step`` would be
    written to when it is a symbolic link (see :func:`save_shard`)."""
    _refuse_writing_through(step_dir(directory, step))


def _refuse_writing_through(d: Path, always: bool = False) -> None:
    """A step directory that is a symbolic link is never written through (nor created, renamed or
    removed in): what it points to may be another run's checkpoint, or anything else."""
    if always or d.is_symlink():
        raise CheckpointError(
            f"cannot write checkpoint {d}: it is a symbolic link, and pipetrain writes checkpoints only into "
            f"step directories of its own, never through links; remove the link, or give the run another "
            f"{option('checkpoint_dir')}"
        )


def write_manifest(
    directory: str | os.PathLike[str], step: int, files: Iterable[Mapping[str, Any]], meta: Mapping[str, Any]
) -> Path:
    """Write the manifest of step ``step`` listing ``files`` (records from :func:`save_shard`):
    the commit point of the checkpoint. Checks first that every file is there with its size."""
    d = step_dir(directory, step)
    _refuse_writing_through(d)
    records = sorted((dict(r) for r in files), key=lambda r: r["name"])
    for r in records:
        path = d / r["name"]
        if not path.is_file():
            raise CheckpointError(
                f"cannot commit checkpoint {d}: {r['name']} is missing here; every rank must write "
                "to a directory all ranks see (one machine, or a shared file system)"
            )
        if path.stat().st_size != r["size"]:
            raise CheckpointError(f"cannot commit checkpoint {d}: {r['name']} changed size while saving")
    manifest = {
        "format": FORMAT,
        "step": step,
        "created": time.time(),
        "files": records,
        "meta": dict(meta),
    }
    text = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
    try:
        _atomic_write(d / MANIFEST, lambda f: f.write(text), follow_links=False)
    except OSError as error:
        if error.errno == errno.ELOOP:
            _refuse_writing_through(d, always=True)
        raise CheckpointError(f"cannot write {d / MANIFEST}: {error.strerror or error}") from None
    return d


def save_checkpoint(
    directory: str | os.PathLike[str], step: int, shards: Mapping[str, Any], meta: Mapping[str, Any]
) -> Path:
    """One process writes a whole checkpoint: every ``name -> state`` of ``shards``, then the
    manifest. Returns the step directory; after a failure nothing of it is left."""
    records: list[dict[str, Any]] = []
    try:
        for name, state in shards.items():
            records.append(save_shard(directory, step, name, state))
        return write_manifest(directory, step, records, meta)
    except CheckpointError:
        _discard(step_dir(directory, step), records)
        raise


_rounds: dict[int, int] = {}


def save_distributed(
    directory: str | os.PathLike[str],
    step: int,
    shards: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    store: Any,
    timeout: float = 300.0,
    key: str | None = None,
    liveness: Any = None,
) -> Path:
    """Collective checkpoint: every rank calls it at the same step with its own ``shards``
    (``{stage_file(s): state}``, or ``{}`` for a rank that saves nothing, such as a second replica).

    Each rank writes its files and publishes their records in ``store``; rank 0 waits for all ranks
    (at most ``timeout`` seconds), writes the manifest, and announces the commit, which the other
    ranks wait for (at most twice as long, to hear rank 0's verdict). A failure on any rank raises
    :class:`CheckpointError` on every rank.

    ``key`` names this save's entries in ``store``; it must differ between any two saves that use
    the same store server (a run's store serves every run of a script, and under torchrun every
    restart). By default saves through one store client are numbered.

    ``liveness`` (a :class:`~pipetrain.runtime.liveness.Liveness`): the waits last as long as the
    ranks waited for are heard from, ``timeout`` seconds of silence, not of work (a large shard
    on a slow disk).
    """
    if key is None:
        n = _rounds[id(store)] = _rounds.get(id(store), 0) + 1
        key = str(n)
    prefix = f"pipetrain/checkpoint/{key}"
    td = timedelta(seconds=timeout)
    d = step_dir(directory, step)
    records: list[dict[str, Any]] = []
    failure: CheckpointError | None = None
    try:
        for name, state in shards.items():
            records.append(save_shard(directory, step, name, state))
    except CheckpointError as error:  # a full disk, a missing permission: every rank hears of it
        failure = error
        _discard(d, records)
        store.set(f"{prefix}/{rank}", json.dumps({"error": str(error)}))
    else:
        store.set(f"{prefix}/{rank}", json.dumps({"files": records}))
    commit = f"{prefix}/commit"
    if rank == 0:
        keys = [f"{prefix}/{r}" for r in range(world_size)]
        try:
            _wait(store, keys, td, liveness, f"the checkpoint files of step {step}", list(range(world_size)))
        except (RuntimeError, PeerTimeoutError):
            late = [r for r, k in enumerate(keys) if not store.check([k])]
            reason = (f"ranks {late} fell silent for {timeout:g} s before finishing their checkpoint files of step {step}"
                      if liveness is not None else
                      f"ranks {late} did not finish their checkpoint files of step {step} within {timeout:g} s")
            store.set(commit, json.dumps({"error": reason, "peer": True}))
            raise CheckpointPeerError(reason) from None
        all_records: list[dict[str, Any]] = []
        errors = []
        for r, k in enumerate(keys):
            answer = json.loads(store.get(k))
            if "error" in answer:
                errors.append(f"rank {r}: {answer['error']}")
            else:
                all_records.extend(answer["files"])
        try:
            if errors:
                _discard(d, all_records)  # every rank has finished: nothing of this save is left half done
                raise CheckpointError(f"checkpoint of step {step} failed on " + "; ".join(errors))
            names = [r["name"] for r in all_records]
            if len(set(names)) != len(names):
                raise CheckpointError(f"two ranks wrote the same checkpoint file: {sorted(names)}")
            path = write_manifest(directory, step, all_records, meta)
        except CheckpointError as error:
            store.set(commit, json.dumps({"error": str(error)}))
            raise
        store.set(commit, json.dumps({"ok": str(path)}))
        return path
    try:  # longer than rank 0 waits, to hear its verdict
        _wait(store, [commit], 2 * td, liveness, f"rank 0's commit of the checkpoint of step {step}", [0])
    except (RuntimeError, PeerTimeoutError):
        if failure is not None:
            raise failure from None
        waited = f"heard nothing from rank 0 for {timeout:g} s" if liveness is not None else f"waited {2 * timeout:g} s"
        raise CheckpointPeerError(
            f"rank {rank} {waited} while waiting for it to commit the checkpoint of step "
            f"{step}: rank 0 is gone or stuck"
        ) from None
    answer = json.loads(store.get(commit))
    if "error" in answer:
        raise (CheckpointPeerError if answer.get("peer") else CheckpointError)(answer["error"])
    return Path(answer["ok"])


def _wait(store: Any, keys: list[str], td: timedelta, liveness: Any, what: str, ranks: list[int]) -> None:
    """Until every key is in ``store``: at most ``td``, or with a ``liveness`` as long as the ranks
    whose keys are missing (``keys[i]`` is ``ranks[i]``'s) are heard from."""
    if liveness is None:
        store.wait(keys, td)
        return
    missing = list(zip(ranks, keys))

    def ready() -> bool:
        missing[:] = [(r, k) for r, k in missing if not store.check([k])]
        return not missing

    liveness.wait_until(ready, lambda: [r for r, _ in missing], what)


def _discard(d: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Remove the files of a save that failed (``records``: those written), and the step
    directory if nothing else is left in it; never the files of a committed checkpoint."""
    if (d / MANIFEST).exists():
        return
    for record in records:
        if _plain_name(record.get("name")):
            (d / record["name"]).unlink(missing_ok=True)
    try:
        d.rmdir()  # only when empty
    except OSError:
        pass


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
    lets :func:`check_compatible` refuse a resume into a different run, naming the difference.

    With several ranks, :func:`save_distributed` is called by every rank at the same step: each writes
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
        a pickle could run code. Save RNG states with :func:`capture_rng`, not as numpy objects.
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
            text = _first_line(error)
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


def _first_line(error: BaseException) -> str:
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
        if not _plain_name(name):
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
        raise CheckpointError(f"checkpoint {d} has an unreadable {MANIFEST}: {_first_line(error)}") from None
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


def _step_entries(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step-N`` entry under ``directory``, links included, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), child) for child in root.iterdir() if (m := _STEP_DIR.match(child.name)))


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``directory`` (complete or not), oldest first; a
    symbolic link named ``step-N`` is not one (see :func:`find_latest`)."""
    return [(step, path) for step, path in _step_entries(directory) if not path.is_symlink() and path.is_dir()]


def find_latest(
    directory: str | os.PathLike[str], *, verify: bool = True, skipped: list[str] | None = None
) -> Checkpoint | None:
    """The newest complete checkpoint under ``directory``, or None. Newer step directories that are
    incomplete or damaged, and links named ``step-N``, are skipped with a warning that says why
    (appended to ``skipped`` instead, when given: a run that resumes by itself says so in its
    own words)."""
    for _, path in reversed(_step_entries(directory)):
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
    if p.name == MANIFEST or _STEP_DIR.match(p.name) or (p / MANIFEST).exists():
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
        _fsync_dir(path)
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
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():  # GPUs this machine lacks: their states are dropped
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
