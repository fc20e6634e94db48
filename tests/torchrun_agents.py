"""Two torchrun agents of one job on this machine, the first hosting the c10d rendezvous, one
worker each: the multi-machine path, for the tests that need it.

The rendezvous port must be named before either agent starts, so it is picked free and given to
them; another process may take it in between. :func:`run` starts the agents again on another port
when the host agent found its port taken (up to three times), so that race cannot fail a test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, Sequence

__all__ = ["start", "finish", "run"]

_TAKEN = ("Address already in use", "EADDRINUSE")


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(entry: Sequence[str], *, rdzv_id: str, restarts: int = 0, env: dict | None = None, outputs: Any = None,
          join_timeout: int = 90, port: int | None = None) -> list[subprocess.Popen]:
    """The two agents running ``entry`` (a script and its arguments, or ``-m module ...``); their
    output piped, or written to ``outputs`` (one file per agent)."""
    port = _port() if port is None else port
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                       **(env or {}))
    return [
        subprocess.Popen([
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={1 - node},join_timeout={join_timeout}", "--max-restarts", str(restarts),
            "--monitor-interval", "0.1", *entry,
        ], stdout=subprocess.PIPE if outputs is None else outputs[node], stderr=subprocess.STDOUT, text=True,
            env=environment)
        for node in (0, 1)
    ]  # fmt: skip


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Every agent's output once it ended (killed after ``timeout`` seconds)."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


def run(entry: Sequence[str], *, timeout: float = 240, **options: Any) -> tuple[list[int], str]:
    """Start the agents, wait for them; ``(exit statuses, their output)``; started again on a new
    port when the rendezvous port was taken."""
    for _ in range(3):
        procs = start(entry, **options)
        text = "\n".join(finish(procs, timeout))
        codes = [proc.returncode for proc in procs]
        if not (any(codes) and any(taken in text for taken in _TAKEN)):
            break
    return codes, text
