"""The worker processes a ``pipetrain train`` launcher started, by rank (tests and
benchmarks/fault_times.py stop or kill one of them)."""

from __future__ import annotations

import os
import signal


def workers(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the workers a launcher process started (its children, by their RANK)."""
    found = {}
    for task in os.listdir(f"/proc/{launcher}/task"):
        try:
            with open(f"/proc/{launcher}/task/{task}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/environ", "rb") as e:
                    variables = dict(v.split(b"=", 1) for v in e.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if b"RANK" in variables:
                found[int(variables[b"RANK"])] = pid
    return found


def kill_stopped(pid: int | None) -> None:
    """SIGKILL a worker a test stopped, unless it is gone already (the run's own verdict killed it)."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
