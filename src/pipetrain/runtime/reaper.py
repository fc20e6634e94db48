"""Completing sends in the background, so that a rank never blocks on what it sends.

A gloo send completes only when the receiver has posted the matching receive, and its work cannot
be polled. Waiting for sends in program order could block a rank on a peer that is itself waiting
for this rank's next message; never waiting would keep every message buffer alive. The reaper
thread waits for each send in turn (gloo releases the GIL while it waits), freeing its buffer as
soon as the peer took it; an error is handed to the program, which raises it at its next action.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["SendReaper"]


class SendReaper:
    """Waits for send handles in a daemon thread, in the order they were sent."""

    def __init__(self) -> None:
        self._queue: deque = deque()
        self._condition = threading.Condition()
        self._busy = False
        self._closing = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pipetrain-send-reaper", daemon=True)
        self._thread.start()

    def add(self, handle: Any) -> None:
        with self._condition:
            self._queue.append(handle)
            self._condition.notify()

    def check(self) -> None:
        """Raise the first error a send ran into (a lost peer, a timeout)."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closing:
                    self._condition.wait()
                if not self._queue:
                    return
                handle = self._queue.popleft()
                self._busy = True
            try:
                handle.wait(report=False)
            except BaseException as error:  # noqa: BLE001 - handed to the program thread
                if self.error is None:
                    self.error = error
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()

    def drain(self) -> None:
        """Wait until every send handed over so far has completed (each bounded by its timeout),
        stop the thread and raise the first error."""
        with self._condition:
            while (self._queue or self._busy) and self.error is None:
                self._condition.wait(timeout=0.5)
            self._closing = True
            self._condition.notify_all()
        self._thread.join(timeout=5.0)
        self.check()
