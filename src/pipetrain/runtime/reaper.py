"""Completing sends in the background, so that a rank never blocks on what it sends.

A gloo send completes only when the receiver has posted the matching receive, and its work cannot
be polled. Waiting for sends in program order could block a rank on a peer that is itself waiting
for this rank's next message; never waiting would keep every message buffer alive. The reaper
thread waits for each send in turn (gloo releases the GIL while it waits), freeing its buffer as
soon as the peer took it; an error is handed to the program, which raises it at its next action.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

__all__ = ["SendReaper"]

_STOP = object()


class SendReaper:
    """Waits for send handles in a daemon thread, in the order they were sent."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pipetrain-send-reaper", daemon=True)
        self._thread.start()

    def add(self, handle: Any) -> None:
        self._queue.put(handle)

    def check(self) -> None:
        """Raise the first error a send ran into (a lost peer, a timeout)."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is _STOP:
                return
            if self.error is not None:
                continue  # after a failure, only drain the queue
            try:
                handle.wait(report=False)
            except BaseException as error:  # noqa: BLE001 - handed to the program thread
                self.error = error

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every send handed over so far has completed (each is bounded by the
        messenger's timeout), stop the thread and raise the first error."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self.check()
