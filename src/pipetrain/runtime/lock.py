"""One run at a time in a checkpoint directory: a lock file that names the run holding it.

Two runs writing checkpoints into one directory prune each other's steps and resume from each
other's state. So a run takes ``DIR/.pipetrain-lock`` first: an exclusive ``flock`` on the file,
which the kernel releases when the holder dies however it dies (a lock left by a killed run is
taken over, and said so), and in the file the holder's identity, which a refused run names::

    checkpoint directory ck is in use by another run (pid 4242 on host1, since 2025-01-07 10:31:02:
    pipetrain train --schedule pipedream ...); let it finish, or give this run another --checkpoint-dir

The lock belongs to a *run*, not to a process: pipetrain's launcher holds it for every start of
its workers (``--max-restarts``) and hands its identity to them (:data:`RUN_ID`), so its workers
are never refused by their own run's lock. Under torchrun, rank 0 takes it, as the torchrun job
(``TORCHELASTIC_RUN_ID``, the same for every restart): a restarted rank 0 takes over the lock its
dead predecessor left. Held locks are released at the end of the run (the file is removed).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pipetrain.errors import option
from pipetrain.runtime.errors import CheckpointError

__all__ = ["LOCK", "RUN_ID", "DirectoryLock", "run_identity", "new_run_identity"]

#: The lock file of a checkpoint directory (hidden: it is no step directory).
LOCK = ".pipetrain-lock"
#: The environment variable in which pipetrain's launcher tells its workers which run they belong to.
RUN_ID = "PIPETRAIN_RUN_ID"


def new_run_identity() -> str:
    """A fresh identity for a run that pipetrain's launcher starts (its workers inherit it)."""
    return f"pipetrain run {uuid.uuid4().hex[:12]}"


def run_identity() -> str:
    """The run this process belongs to: the one its launcher named (:data:`RUN_ID`), a torchrun job
    (every restart is the same job), or else this process alone."""
    env = os.environ
    if env.get(RUN_ID):
        return env[RUN_ID]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun job {env['TORCHELASTIC_RUN_ID']}"
    return f"process {os.getpid()} on {socket.gethostname()}"


class DirectoryLock:
    """The exclusive use of checkpoint directory ``directory`` by run ``run`` (see the module
    docstring). :meth:`acquire` takes it or refuses with a :class:`CheckpointError` naming the run
    that holds it; :meth:`release` gives it back (only if this object took it)."""

    def __init__(self, directory: str | os.PathLike[str], run: str | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self.run = run if run is not None else run_identity()
        self._fd: int | None = None
        self._made = False  # whether acquire created the directory (removed again when left empty)

    def acquire(self) -> str:
        """Take the lock. Returns a line to print when a lock left by a run that no longer runs was
        taken over ("" otherwise, and when this run's launcher already holds it)."""
        self._made = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the holder may remove the file between our open and our flock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _holder(fd)
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no locks on this file system
                    return self._acquire_unlocked(holder)
                if holder.get("run") == self.run:
                    return ""  # held for this very run, by its launcher
                raise CheckpointError(self._refusal(holder)) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # we locked a file its holder has just removed: try the new one
                os.close(fd)
                continue
            previous = _holder(fd)
            _write(fd, self._identity())
            self._fd = fd
            if previous and previous.get("run") != self.run:
                return (f"took over the lock of {self.directory} left by {_describe(previous)}, which no longer "
                        "runs (killed, or its machine went down)")
            return ""
        raise CheckpointError(f"cannot lock checkpoint directory {self.directory}: its lock file keeps changing")

    def _open(self) -> int:
        """The lock file, opened (created if missing) without following a symbolic link: a link
        there, or anything else that is not a regular file, is refused in one line, untouched."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise CheckpointError(
                    f"cannot lock checkpoint directory {self.directory}: its lock file {LOCK} is a symbolic link, "
                    f"which pipetrain never writes through; remove it, or give this run another "
                    f"{option('checkpoint_dir')}"
                ) from None
            raise CheckpointError(f"cannot lock checkpoint directory {self.directory}: cannot open {self.path} "
                                  f"({error.strerror or error})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"cannot lock checkpoint directory {self.directory}: {self.path} is not a regular "
                                  f"file; remove it, or give this run another {option('checkpoint_dir')}")
        return fd

    def _acquire_unlocked(self, holder: dict[str, Any]) -> str:
        """Where the file system has no locks: the holder named in the file is alive if its process
        runs on this machine (or runs elsewhere: that cannot be checked from here)."""
        if holder and holder.get("run") != self.run and _alive(holder):
            raise CheckpointError(self._refusal(holder))
        fd = self._open()
        try:
            _write(fd, self._identity())
        finally:
            os.close(fd)
        return ""

    def release(self) -> None:
        """Remove the lock file and give the lock back, if this object holds it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                os.unlink(self.path)  # while still locked: a run that opened it meanwhile sees a new file
        except OSError:
            pass
        finally:
            os.close(fd)
        if self._made:
            try:
                self.directory.rmdir()  # a run that wrote nothing leaves no directory behind
            except OSError:
                pass

    def _identity(self) -> dict[str, Any]:
        return {"run": self.run, "pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": _command()}

    def _refusal(self, holder: dict[str, Any]) -> str:
        who = _describe(holder) if holder else "a run that is starting (its identity is not written yet)"
        return (f"checkpoint directory {self.directory} is in use by another run ({who}); let it finish, or give "
                f"this run another {option('checkpoint_dir')}")


def _command() -> str:
    """This process's command line, shortened, on one line (``pipetrain train ...`` for the CLI)."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if program in ("cli.py", "__main__.py"):
        program = "pipetrain"
    text = " ".join([program, *sys.argv[1:]]).replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def _describe(holder: dict[str, Any]) -> str:
    """``pid 4242 on host1, since 2025-01-07 10:31:02: pipetrain train ...``"""
    text = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
    return f"{text}: {holder['command']}" if holder.get("command") else text


def _holder(fd: int) -> dict[str, Any]:
    """What the lock file says of its holder ({} when empty or unreadable)."""
    try:
        data = os.pread(fd, 64 * 1024, 0)
        value = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write(fd: int, identity: dict[str, Any]) -> None:
    data = json.dumps(identity).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _alive(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid", 0))
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True
