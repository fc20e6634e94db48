"""What every rank is doing, published a few times a second, for the report of a failure."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from pipetrain.runtime.rendezvous import run_store

__all__ = [
    "StatusBoard", "read_status", "format_status", "diagnose", "env_store", "default_prefix", "publish_error",
    "read_errors",
]

_PREFIX = "status"


def record_key(prefix: str, rank: int) -> str:
    """The store key of ``rank``'s status record."""
    return f"{prefix}/{rank}"


def error_key(prefix: str, rank: int) -> str:
    """The store key of the error ``rank`` left for the launcher (:func:`publish_error`)."""
    return f"{prefix}/error/{rank}"


def default_prefix() -> str:
    """Key prefix of the status records in the run's store (:func:`env_store`, whose keys are
    already those of this start of the workers)."""
    return _PREFIX


def env_store(timeout: float = 10.0) -> Any:
    """A client of the TCPStore at MASTER_ADDR:MASTER_PORT (the launcher's or torchrun's store,
    or the one rank 0 hosts), seen through the keys of this start of the workers
    (:func:`~pipetrain.runtime.rendezvous.run_store`: torchrun keeps one store for all restarts).
    A separate connection, so status traffic never queues behind the process group's own store
    operations."""
    return run_store(dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    ))


class StatusBoard:
    """This rank's recent actions and current wait, published to a store in the background.

    When a rank dies or hangs, its peers only see a receive that never completes. To print something
    better than "timed out", every rank keeps its last few completed actions in memory (a deque append
    on the hot path, nothing else) and a background thread publishes them, together with the action it
    is waiting for, to a key-value store (the c10d TCPStore of the run) a few times a second. A rank
    that fails, or the launcher that sees a worker die, reads every rank's record with a short timeout
    and prints them::

        status of every rank (most recent action last):
          rank 0: waiting 5.1 s for RECV_B of microbatch 1 from rank 1; done: F0 F1 F2 B0; seen 0.2 s ago
          rank 1: busy (not communicating); done: F0 F1 B0 F2; seen 0.1 s ago
          rank 2: silent for 6.3 s (dead or frozen); last done: F0 B0; was waiting for RECV_F ...

    A rank stuck in computation still publishes (the thread runs while the main thread computes or
    sleeps), so "busy" with an old last action means it hangs in compute; a silent rank is dead.

    Hot path: ``board.done(action)`` (a bound ``deque.append``: the action object is stored, its
    ``str()`` taken only when published) and ``board.waiting = what`` (set and cleared by the
    :class:`~pipetrain.runtime.p2p.Messenger` around every wait). ``board.note`` is free text
    (for example ``"step 12"``). :meth:`report` reads every rank's record.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        keep: int = 8,
        interval: float = 0.25,
        prefix: str | None = None,
        address: tuple[str, int] | None = None,
        start: bool = True,
    ) -> None:
        self.store = store
        self.address = address
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.prefix = prefix if prefix is not None else default_prefix()
        self.recent: deque[object] = deque(maxlen=keep)
        self.done: Callable[[object], None] = self.recent.append
        self.waiting: object = None
        self.peer: int | None = None  # the rank that ``waiting`` waits for, when one
        self.note: str = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen_waiting: object = None
        self._waiting_since = 0.0
        self._failures = 0
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_env(cls, **kwargs: Any) -> StatusBoard:
        """A board on the run's store (see :func:`env_store`), rank and world size from the
        environment that :func:`pipetrain.runtime.launch.init_distributed` read."""
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        return cls(
            env_store(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), address=address, **kwargs
        )

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"pipetrain-status-{self.rank}", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Publish one last time and stop the background thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1.0)
            self._thread = None
        self.publish()

    def __enter__(self) -> StatusBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self) -> dict[str, Any]:
        """This rank's record as published."""
        now = time.monotonic()
        waiting = self.waiting
        if waiting is not self._seen_waiting:
            self._seen_waiting = waiting
            self._waiting_since = now
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "done": [str(a) for a in list(self.recent)],
            "waiting": None if waiting is None else str(waiting),
            "peer": None if waiting is None else self.peer,
            "waiting_s": round(now - self._waiting_since, 3) if waiting is not None else 0.0,
            "note": self.note,
            "closed": self._stop.is_set(),  # its last record: the rank goes on without a board, not silent
        }

    def publish(self) -> bool:
        """Write this rank's record to the store now; False if the store did not take it."""
        if self._failures:  # the store is gone (each failed call prints a C++ warning): stop trying
            return False
        try:
            data = json.dumps(self.record())
            with self._lock:
                self.store.set(record_key(self.prefix, self.rank), data)
            self._failures = 0
            return True
        except Exception:
            self._failures += 1
            return False

    def _run(self) -> None:
        self.publish()
        while not self._stop.wait(self.interval):
            self.publish()

    def report(self, timeout: float = 2.0, gone: dict[int, str] | None = None) -> str:
        """Every rank's last published record, formatted; never blocks longer than ``timeout``.
        ``gone``: ranks this one knows ended (a closed connection), see :func:`format_status`."""
        if self.address is not None and not _reachable(self.address, min(timeout, 1.0)):
            records = None  # skip the store client: on a dead server it prints C++ stack traces
        else:
            self.publish()
            records = read_status(self.store, self.world_size, prefix=self.prefix, timeout=timeout, lock=self._lock)
        return format_status(records, self.world_size, stale_after=self.stale_after, gone=gone)

    @property
    def stale_after(self) -> float:
        """Seconds after which a record that stopped updating means a dead or frozen rank."""
        return 3 * self.interval + 1.0


def publish_error(store: Any, rank: int, message: str, *, prefix: str | None = None) -> bool:
    """Leave the message of this rank's own error (a user error, not a lost peer) in the store,
    where the launcher reports it as the run's one message and its peers see that they only lost
    the rank that failed. False if the store did not take it."""
    try:
        store.set(error_key(prefix if prefix is not None else default_prefix(), rank), message)
        return True
    except Exception:
        return False


def read_errors(store: Any, world_size: int, *, prefix: str | None = None, timeout: float = 1.0) -> dict[int, str]:
    """The messages :func:`publish_error` left, by rank (empty if the store does not answer)."""
    prefix = prefix if prefix is not None else default_prefix()
    found: dict[int, str] = {}

    def read() -> None:
        try:
            for rank in range(world_size):
                key = error_key(prefix, rank)
                if store.check([key]):
                    found[rank] = store.get(key).decode("utf-8", "replace")
        except Exception:
            pass

    thread = threading.Thread(target=read, name="pipetrain-error-read", daemon=True)
    thread.start()
    thread.join(timeout)
    return dict(found)


def _reachable(address: tuple[str, int], timeout: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def read_status(
    store: Any,
    world_size: int,
    *,
    prefix: str | None = None,
    timeout: float = 2.0,
    lock: threading.Lock | None = None,
) -> dict[int, dict[str, Any]] | None:
    """Every rank's published record (missing ranks left out), or None if the store did not answer
    within ``timeout`` seconds (it may be gone with the process that hosted it)."""
    prefix = prefix if prefix is not None else default_prefix()
    result: dict[int, dict[str, Any]] = {}
    finished = threading.Event()

    def read() -> None:
        try:
            for rank in range(world_size):
                key = record_key(prefix, rank)
                if lock is not None:
                    with lock:
                        present = store.check([key])
                        data = store.get(key) if present else None
                else:
                    present = store.check([key])
                    data = store.get(key) if present else None
                if data is not None:
                    result[rank] = json.loads(data)
            finished.set()
        except Exception:
            pass

    thread = threading.Thread(target=read, name="pipetrain-status-read", daemon=True)
    thread.start()
    thread.join(timeout)
    return dict(result) if finished.is_set() else None


def format_status(
    records: dict[int, dict[str, Any]] | None,
    world_size: int,
    *,
    stale_after: float = 2.0,
    gone: dict[int, str] | None = None,
) -> str:
    """Human-readable lines, one per rank, from :func:`read_status`'s records, and a "likely
    cause" line for each rank that others wait for when the records support one (see
    :func:`diagnose`). ``gone``: ranks known to have ended, with how (``"was killed by
    SIGKILL"``), which the launcher knows from their exit statuses."""
    if records is None:
        return "status of the other ranks: unavailable (the store did not answer; its host may be gone)"
    gone = gone or {}
    now = time.time()
    lines = ["status of every rank (most recent action last):"]
    for rank in range(world_size):
        rec = records.get(rank)
        if rec is None:
            ended = f"{gone[rank]}, with " if rank in gone else ""
            lines.append(f"  rank {rank}: {ended}no status published (not started, or died before its first report)")
            continue
        age = max(0.0, now - rec["time"])
        done = " ".join(rec["done"]) if rec["done"] else "(nothing yet)"
        note = f" [{rec['note']}]" if rec.get("note") else ""
        if rec["waiting"] is not None:
            doing = f"waiting {rec['waiting_s']:.1f} s for {rec['waiting']}"
        else:
            doing = "busy (not communicating)"
        if rank in gone:
            lines.append(f"  rank {rank}{note}: {gone[rank]}; last done: {done}; was {doing}")
        elif age > stale_after:
            lines.append(
                f"  rank {rank}{note}: silent for {age:.1f} s (dead or frozen); last done: {done}; "
                f"was {doing}"
            )
        else:
            lines.append(f"  rank {rank}{note}: {doing}; done: {done}; seen {age:.1f} s ago")
    lines.extend(f"likely cause: rank {peer} {state} (rank(s) {', '.join(map(str, waiters))} wait for it)"
                 for peer, state, waiters in diagnose(records, stale_after=stale_after, gone=gone, now=now))
    return "\n".join(lines)


def diagnose(
    records: dict[int, dict[str, Any]],
    *,
    stale_after: float = 2.0,
    gone: dict[int, str] | None = None,
    now: float | None = None,
) -> list[tuple[int, str, list[int]]]:
    """The ranks that others wait for, each with what it is doing and who waits: ``[(rank,
    state, waiters)]``, only where the records support a cause. A rank that ended (``gone``) is
    the cause when others wait for it; one whose record stopped updating died or is frozen
    (SIGSTOP); one that publishes but does not communicate hangs in its computation. Two ranks
    are said to deadlock only when both have waited for each other for ``stale_after`` seconds
    or more and both still publish: a dead rank's last record, or two waits that are about to be
    met, say nothing about the programs."""
    gone = gone or {}
    now = time.time() if now is None else now

    def stale(rec: dict[str, Any]) -> bool:
        return now - rec["time"] > stale_after

    waits = {
        r: rec["peer"]
        for r, rec in records.items()
        if rec.get("waiting") is not None and rec.get("peer") is not None and not stale(rec) and r not in gone
    }
    out = []
    for peer in sorted(set(waits.values())):
        waiters = [r for r, p in sorted(waits.items()) if p == peer]
        rec = records.get(peer)
        if peer in gone:
            state = gone[peer]
        elif rec is None:
            state = "has published no status (it never started, or died at once)"
        elif stale(rec):
            state = f"is silent for {now - rec['time']:.1f} s: it died or is frozen (stopped, for instance by SIGSTOP)"
        elif rec.get("waiting") is None:
            state = "is busy and not communicating: it hangs in its computation, or is far slower"
        elif (waits.get(peer) in waiters and rec.get("waiting_s", 0.0) >= stale_after
              and records[waits[peer]].get("waiting_s", 0.0) >= stale_after):
            state = (
                f"waits for rank {waits[peer]}, which waits for it: the two programs deadlock "
                "(their sends and receives are not in matching order)"
            )
        else:
            continue  # it waits for someone else (follow the chain from there), or only just started to
        out.append((peer, state, waiters))
    return out
