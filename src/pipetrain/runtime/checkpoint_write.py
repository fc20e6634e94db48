"""Writing checkpoints: every file atomically (temporary name, fsync, rename), the manifest last.

One process writes a whole checkpoint with :func:`save_checkpoint`; with several ranks each calls
:func:`save_distributed` at the same step, and rank 0 commits the manifest once every rank's files
are written (see :class:`pipetrain.runtime.checkpoint_read.Checkpoint` for the layout). Nothing is
written through a symbolic link, and a failed save leaves nothing behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

import torch

from pipetrain.errors import option
from pipetrain.paths import termination_deferred
from pipetrain.runtime.checkpoint_layout import FORMAT, MANIFEST, plain_name, step_dir
from pipetrain.runtime.errors import CheckpointError, CheckpointPeerError, PeerTimeoutError

__all__ = ["save_torch_file", "save_shard", "check_step_dir", "write_manifest", "save_checkpoint",
           "save_distributed", "fsync_dir"]


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


def fsync_dir(path: Path) -> None:
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



def _check_name(name: str) -> None:
    if not plain_name(name):
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
        if plain_name(record.get("name")):
            (d / record["name"]).unlink(missing_ok=True)
    try:
        d.rmdir()  # only when empty
    except OSError:
        pass
