"""The death of a DataLoader worker process: told as one error, where the batch is taken.

torch reports a worker that died from its SIGCHLD handler, in whatever the training thread does
at that moment; while a :class:`~pipetrain.data.prefetch.Receiver` is open the report is kept
here instead and raised by the take that would have returned the batch, as the
:class:`~pipetrain.errors.DataWorkerLost` of :func:`lost_data_worker`.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from typing import Any

import torch

from pipetrain.errors import DataWorkerLost, option

__all__ = ["lost_data_worker", "death_behind", "signal_report", "keep_worker_deaths", "give_worker_deaths_back",
           "pending_death"]

#: how torch reports a DataLoader worker that died (its SIGCHLD handler, or the loader's own check)
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) "
                          r"(?:is killed by signal: ([^.]+)\.|exited unexpectedly(?: with exit code (-?\d+))?)")


def lost_data_worker(error: BaseException, rank: int | None = None):
    """The :class:`~pipetrain.runtime.errors.DataWorkerLost` that ``error`` (torch's RuntimeError
    for a DataLoader worker that died) stands for, or None for any other error. torch raises it
    from its SIGCHLD handler wherever the training thread is, or where the batch is taken."""
    found = _WORKER_DIED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    pids, described, code = found.groups()
    number = next((s for s in signal.valid_signals() if described and signal.strsignal(s) == described.strip()), None)
    how = (f"was killed by {signal.Signals(number).name}" if number else f"was killed by signal '{described}'"
           if described else f"exited with status {code}" if code else "exited unexpectedly")
    oom = " (the kernel's out-of-memory killer sends SIGKILL: check the machine's memory)" if number == 9 else ""
    whose = f"rank {rank}: " if rank is not None else ""
    return DataWorkerLost(f"{whose}the DataLoader worker process (pid {pids.strip()}) reading its batches {how}{oom}; "
                          f"a fault, not bad data ({option('max_restarts')} starts the workers again, to resume from "
                          f"{option('checkpoint_dir')})", number)


_died: list[RuntimeError] = []  # torch's report of a data worker that died, kept for the next take
_held: list[Any] = []  # while receivers are open: the SIGCHLD handler they replaced (torch's)


def _on_child(signum: int, frame: Any) -> None:
    try:
        torch._C._error_if_any_worker_fails()
    except RuntimeError as error:
        _died.append(error)


def death_behind(error: BaseException, iterator: Any) -> BaseException:
    """torch's report of a DataLoader worker that died, when one did, instead of ``error``: the
    iterator itself may only see a pipe to it break (``ConnectionResetError``), a moment before
    the worker's exit is seen (so a broken pipe waits up to a second for it), or say it "exited
    unexpectedly" after reaping it, when only the worker's own exit code still tells the signal."""
    deadline = time.monotonic() + (1.0 if isinstance(error, (OSError, EOFError)) else 0.0)
    while True:
        for process in getattr(iterator, "_workers", ()):  # a DataLoader iterator's worker processes
            code = process.exitcode
            if code is not None and code < 0:  # in torch's words, which lost_data_worker reads
                return RuntimeError(f"DataLoader worker (pid {process.pid}) is killed by signal: "
                                    f"{signal.strsignal(-code)}. ")
        try:
            torch._C._error_if_any_worker_fails()
        except RuntimeError as death:
            return death
        if time.monotonic() >= deadline:
            return error
        time.sleep(0.02)


def signal_report(error: BaseException) -> BaseException:
    """For an error that says a data worker is gone without saying how (torch's "exited
    unexpectedly", a broken pipe to it), the SIGCHLD handler's report, which names the signal,
    when it comes within a second (it runs on this, the main, thread: sleeping lets it)."""
    if not (isinstance(error, (OSError, EOFError)) or (lost_data_worker(error) is not None
                                                        and lost_data_worker(error).signal is None)):
        return error
    deadline = time.monotonic() + (1.0 if _held else 0.0)
    while not _died and time.monotonic() < deadline:
        time.sleep(0.02)
    return _died.pop(0) if _died else error


def keep_worker_deaths() -> bool:
    """Replace torch's SIGCHLD handler, which raises the death of a DataLoader worker in whatever
    the training thread does at that moment (a forward, a checkpoint, a collective: each would
    report it as its own failure), by one that keeps it for :meth:`pipetrain.data.prefetch.Receiver.take`, until the last
    receiver closes. Called after the loader's iterator exists (its creation installs torch's
    handler); main thread only. True if this call replaced it (the caller gives it back)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not _held:
        _died.clear()  # deaths before this run are not its business
        _held.append(signal.signal(signal.SIGCHLD, _on_child))
    else:
        _held.append(None)
    return True


def give_worker_deaths_back() -> None:
    previous = _held.pop()
    if not _held and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, previous if previous is not None else signal.SIG_DFL)


def pending_death() -> RuntimeError | None:
    """The first death kept by the handler of :func:`keep_worker_deaths` and not yet raised."""
    return _died.pop(0) if _died else None
