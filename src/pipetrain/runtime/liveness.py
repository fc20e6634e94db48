"""Waiting on another rank for as long as it is heard from: around long work, ``--timeout``
measures a peer's silence, not the length of its work.

A gloo wait cannot be polled or cut short, and one that times out closes the connection, so its
timeout bounds the whole wait: a peer that works longer than ``--timeout`` before it sends looks
dead. An evaluation is such work (the last stage waits for the first held-out batch to cross every
stage before it, each a forward of 64 samples or more), and so is writing a large shard or
checkpoint while the other ranks wait for it. Around them, ranks tell each other through the run's
store when a message is on its way, and when they are done, and wait on the store instead,
polling it: such a wait lasts as long as the rank it waits for keeps publishing its status record
(:class:`~pipetrain.runtime.status.StatusBoard`: four times a second, from a thread of its own,
whatever its main thread computes or writes) and fails once that record has stood still for
``timeout`` seconds, by this process's clock: that rank is stopped (SIGSTOP), frozen or dead. The
gloo transfer that follows is then waited on with the usual timeout, which bounds the transfer only.

Training's own messages keep plain gloo waits (a poll per message would cost the hot path), where a
peer that computes longer than ``--timeout`` between two messages still times out.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Sequence

from pipetrain.errors import option
from pipetrain.runtime.errors import PeerLostError, PeerTimeoutError
from pipetrain.runtime.status import env_store, error_key, record_key

__all__ = ["Liveness", "new_prefix"]

#: Seconds between two readings of a rank's status record while waiting for it (its board
#: publishes every 0.25 s, so a reading more often sees nothing new).
READ_EVERY = 0.25

_serial = itertools.count()


def new_prefix() -> str:
    """Store keys of one more run in this process (every rank starts the same runs in the same
    order, so the ranks of a run agree on it; a script's runs share the store)."""
    return f"pipetrain/live/{next(_serial)}"


class Liveness:
    """Counts, values and arrivals in ``store`` (a client this object alone uses), waited for
    while the rank that provides them keeps publishing its status record under
    ``status_prefix/RANK`` (:class:`~pipetrain.runtime.status.StatusBoard`'s keys).

    ``board``: this rank's own board, which shows each of these waits as it shows a receive
    (``waiting 40.2 s for ...``) and whose report of every rank ends a silence's error message.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        prefix: str,
        status_prefix: str,
        board: Any = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.prefix = prefix
        self.status_prefix = status_prefix
        self.board = board
        self._heard: dict[int, tuple[bytes | None, float]] = {}  # rank: (its record, when it last changed)

    @classmethod
    def for_board(cls, board: Any, timeout: float, prefix: str) -> Liveness:
        """For a run's board made by :meth:`StatusBoard.from_env`: a store client of its own on
        the same server."""
        return cls(env_store(timeout), board.rank, board.world_size, timeout, prefix=prefix,
                   status_prefix=board.prefix, board=board)

    # -- what ranks tell each other ------------------------------------------------------------

    def post(self, name: str) -> None:
        """One more of ``name`` is ready (a message sent): the count :meth:`await_count` reads."""
        self.store.add(self._key(name), 1)

    def put(self, name: str, value: str) -> None:
        """Leave ``value`` under ``name`` for :meth:`await_value`."""
        self.store.set(self._key(name), value)

    def await_count(self, name: str, count: int, peer: int, what: str) -> None:
        """Until ``count`` of ``name`` were posted, as long as ``peer``, which posts them, is heard from."""
        key = self._key(name)
        self.wait_until(lambda: int(self.store.add(key, 0)) >= count, lambda: [peer], what)

    def await_value(self, name: str, peer: int, what: str) -> str:
        """The value ``peer`` puts under ``name``, waited for as long as ``peer`` is heard from."""
        key = self._key(name)
        self.wait_until(lambda: bool(self.store.check([key])), lambda: [peer], what)
        return self.store.get(key).decode("utf-8")

    def arrive(self, name: str, what: str, ranks: Sequence[int] | None = None) -> None:
        """A barrier of ``ranks`` (default: all): this rank is at ``name``; wait until every other
        one is, as long as each rank not there yet is heard from."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        self.store.set(self._key(f"{name}/{self.rank}"), "1")
        keys = {r: self._key(f"{name}/{r}") for r in ranks}
        missing = [r for r in ranks if r != self.rank]

        def ready() -> bool:
            missing[:] = [r for r in missing if not self.store.check([keys[r]])]
            return not missing

        self.wait_until(ready, lambda: missing, what)

    # -- the wait ------------------------------------------------------------------------------

    def silent_for(self, rank: int) -> float:
        """Seconds since ``rank``'s status record last changed, as far as this rank has seen (since
        the first reading, when it has not seen it change yet)."""
        now = time.monotonic()
        key = record_key(self.status_prefix, rank)
        record = self.store.get(key) if self.store.check([key]) else None
        seen = self._heard.get(rank)
        if seen is None or seen[0] != record:
            self._heard[rank] = (record, now)
            return 0.0
        return now - seen[1]

    def failed(self, rank: int) -> bool:
        """Whether ``rank`` stopped on an error of its own and left it for the launcher
        (:func:`~pipetrain.runtime.status.publish_error`): it will not be heard from again, and
        its peers need not wait out its silence."""
        return bool(self.store.check([error_key(self.status_prefix, rank)]))

    def wait_until(self, ready: Callable[[], bool], awaited: Callable[[], list[int]], what: str) -> None:
        """Poll ``ready`` (quickly at first, then every 50 ms) until it holds; raise
        :class:`~pipetrain.runtime.errors.PeerTimeoutError` when one of the ranks ``awaited()`` names
        (those that can still make it hold) has been silent for the timeout, and
        :class:`~pipetrain.runtime.errors.PeerLostError` as soon as one of them has left its own
        error (:meth:`failed`). ``what`` is what the board and the error say this rank waits for."""
        if ready():
            return
        board = self.board
        if board is not None:
            board.waiting, board.peer = what, (awaited() or [None])[0]
        pause, read_at = 0.001, 0.0
        while not ready():
            now = time.monotonic()
            if now >= read_at:
                read_at = now + READ_EVERY
                for peer in awaited():
                    if self.failed(peer):
                        raise self._lost(peer, what)
                    if self.silent_for(peer) >= self.timeout:
                        raise self._silence(peer, what)
                if board is not None:
                    board.peer = (awaited() or [None])[0]
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        if board is not None:
            board.waiting = None

    def _silence(self, peer: int, what: str) -> PeerTimeoutError:
        # the wait stays on the board, as a timed-out receive's does: the launcher counts this rank
        # among the waiters of the silent one
        error = PeerTimeoutError(
            f"rank {self.rank} heard nothing from rank {peer} for {self.timeout:g} s while waiting for {what}: "
            f"rank {peer} is stopped (SIGSTOP), frozen or dead (a rank at work, however long, keeps publishing "
            f"its status; raise {option('timeout')} only if its machine is too loaded to publish)"
        )
        if self.board is not None:
            try:
                error.args = (f"{error.args[0]}\n{self.board.report()}",)
            except Exception:  # the report is a courtesy; never mask the real error
                pass
        return error

    def _lost(self, peer: int, what: str) -> PeerLostError:
        return PeerLostError(f"rank {self.rank} lost rank {peer} while waiting for {what}: rank {peer} stopped on "
                             "an error of its own (its message says why)")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"
