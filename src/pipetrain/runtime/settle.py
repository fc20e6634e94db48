"""A spawned worker's own process settings, made first, before PyTorch is imported: die with the
launcher, run on the cores the launcher gave it, and load its libraries without the garbage
collector (:mod:`pipetrain.collector`; the worker's entry calls ``loaded`` once its function is
unpickled).

The command that starts a worker (:func:`pipetrain.runtime.launch.launch`) runs :func:`settle`
before it imports :mod:`pipetrain.runtime.launch` and with it PyTorch, so that the threads PyTorch
starts find the worker's cores already set.
"""

from __future__ import annotations

import ctypes
import os
import signal

from pipetrain.collector import pause_for_loading

__all__ = ["settle", "die_with_parent"]


def die_with_parent(parent: int) -> None:
    """End this process (SIGKILL) when its parent ``parent`` dies (PR_SET_PDEATHSIG, Linux): a
    worker must not outlive the launcher or the torchrun agent that watches it, or a lost
    launcher leaves it training alone to the end."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def settle() -> None:
    """Die with the launcher (``PIPETRAIN_PARENT``), pin to the cores ``PIPETRAIN_CPUS`` names, and
    pause the collector while PyTorch and the worker's modules load."""
    pause_for_loading()
    die_with_parent(int(os.environ.get("PIPETRAIN_PARENT", "0")))
    cpus = os.environ.get("PIPETRAIN_CPUS")
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
