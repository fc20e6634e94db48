"""A DataLoader worker process of a pipetrain rank: what it settles before it reads.

A worker forked from a rank closes the rank's TCP sockets, dies with the rank, and may use any
core (:func:`settle_worker`, run by :class:`Unpinned` as the loader's ``worker_init_fn``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
import warnings
from typing import Any, Callable, Iterator

import torch.distributed as dist

__all__ = ["unpinned_workers", "unpin_worker", "drop_rank_sockets", "die_with_rank", "settle_worker", "Unpinned"]


@contextlib.contextmanager
def unpinned_workers(workers: int) -> Iterator[None]:
    """Silence DataLoader's warning that ``workers`` exceed this rank's cores: it counts the cores
    the launcher pinned the rank to, but the workers may use every core (:func:`unpin_worker`).
    More workers than the machine's cores still warn."""
    with warnings.catch_warnings():
        if workers <= (os.cpu_count() or 1):
            warnings.filterwarnings("ignore", message="This DataLoader will create")
        yield


def unpin_worker(_worker_id: int = 0) -> None:
    """In a data worker of a rank that pipetrain's launcher pinned to its own cores
    (``PIPETRAIN_CPUS``): let the worker run on any core. Pinned beside its rank it competes with
    that rank for one core and falls behind whenever the core is busy (benchmarks/RESULTS.md,
    "Data path": the training thread waited 1.3-1.7 s per run for batches pinned, 0.08-0.35 s
    unpinned). Under another launcher (torchrun, numactl) the affinity it was given stays."""
    if os.environ.get("PIPETRAIN_CPUS"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps it inside the cgroup's cpuset
        except (OSError, AttributeError):
            pass


def drop_rank_sockets() -> int:
    """In a data worker forked from a rank of a distributed run: close the rank's TCP sockets
    (gloo's connections to its peers, its store clients), which the fork duplicated. The worker
    never uses them, but while it holds them a peer of a rank that died sees no end of stream
    until the worker notices its parent is gone (torch checks every 5 s): a killed rank that
    reads data was noticed 4.8-4.9 s late. Each is replaced by /dev/null, so that its number is
    not reused. Returns how many were dropped (0 outside a distributed rank, or without /proc)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    dropped = 0
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    continue
                probe = socket.socket(fileno=fd)  # reads the family and type; detached below
            except OSError:
                continue
            tcp = probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
            probe.detach()
            if tcp:
                os.dup2(null, fd)
                dropped += 1
    finally:
        os.close(null)
    return dropped


#: Whether the last fork of this process came from its main thread, and the forking process's
#: pid: read in a data worker (see :func:`die_with_rank`).
_forked = {"main": False, "parent": 0}


def _note_fork() -> None:
    _forked["main"] = threading.current_thread() is threading.main_thread()
    _forked["parent"] = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_note_fork)


def die_with_rank() -> bool:
    """In a data worker: end (SIGKILL) when the rank that forked it dies (PR_SET_PDEATHSIG,
    Linux), instead of up to 5 s later when torch's check of its parent comes round: meanwhile an
    orphaned worker held the rank's stderr, so that a command's pipe (``| tee log``) stayed open
    after the run had ended. Only for a worker forked by the rank's main thread (the signal comes
    when the forking *thread* ends, and the main thread ends with the rank). Returns whether set."""
    if not _forked["main"]:
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != _forked["parent"]:  # the rank died before the prctl took effect
        os._exit(1)
    return True


def settle_worker(worker_id: int = 0) -> None:
    """A data worker's own settings: :func:`drop_rank_sockets`, :func:`die_with_rank`, then
    :func:`unpin_worker`."""
    drop_rank_sockets()
    die_with_rank()
    unpin_worker(worker_id)


class Unpinned:
    """A DataLoader ``worker_init_fn``: :func:`settle_worker` (the rank's sockets closed, any core),
    then the loader's own (``then``)."""

    def __init__(self, then: Callable[[int], Any] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        settle_worker(worker_id)
        if self.then is not None:
            self.then(worker_id)
