"""Asynchronous point-to-point transfer of tensors, tuples of tensors and any nesting of tuples, lists and
dicts of tensors, with timeouts."""

from __future__ import annotations

import datetime
import zlib
from typing import Any, Protocol, Sequence, Union

import torch
import torch.distributed as dist

from pipetrain.errors import PipetrainError, option
from pipetrain.runtime import wire
from pipetrain.structure import Structure, flatten
from pipetrain.runtime.errors import (
    CommunicationError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
)

__all__ = [
    "Messenger",
    "Channel",
    "SendHandle",
    "RecvHandle",
    "Payload",
    "ACTIVATIONS",
    "GRADIENTS",
    "LABELS",
    "MAX_INFO",
]

#: A tensor, a tuple of tensors, or any nesting of tuples, lists and dicts of tensors.
Payload = Union[torch.Tensor, "tuple[torch.Tensor, ...]", Any]

#: Conventional channel kinds (any string works; both ranks must use the same one).
ACTIVATIONS = "act"
GRADIENTS = "grad"
LABELS = "labels"

#: How many user integers (``info=``) a message can carry besides its ``tag``.
MAX_INFO = wire.MAX_INFO


class _Status(Protocol):
    """What the messenger needs from a status board (see :mod:`pipetrain.runtime.status`)."""

    waiting: Any
    peer: int | None

    def report(self) -> str: ...


def _tag_of(kind: str) -> int:
    return zlib.crc32(kind.encode()) & 0x3FFFFFFF


def _normalize(payload: Payload) -> tuple[tuple[torch.Tensor, ...], bool, str | None]:
    """``(tensors, single, structure text)``: a tensor and a tuple of tensors (the fast path) carry
    no structure; any other nesting of tuples, lists and dicts of tensors carries its text."""
    if isinstance(payload, torch.Tensor):
        return (payload,), True, None
    if isinstance(payload, tuple) and all(isinstance(t, torch.Tensor) for t in payload):
        return payload, False, None
    leaves, structure = flatten(payload) if isinstance(payload, (tuple, list, dict)) else ((payload,), None)
    paths = structure.paths() if structure is not None else [f"[{i}]" for i in range(len(leaves))]
    wrong = [f"{path or 'the payload'} is of type {type(leaf).__name__}" for path, leaf in zip(paths, leaves)
             if not isinstance(leaf, torch.Tensor)]
    if wrong:
        raise PipetrainError(
            f"can only send tensors, alone or in tuples, lists and dicts, but {', '.join(wrong[:3])}: pass plain "
            "data (ints, strings) through info= or outside the pipeline"
        )
    return leaves, False, None if structure is None else structure.text


class _SendState:
    __slots__ = ("key", "words", "layout", "total", "hw", "seq", "peer_total", "peer_hw")

    def __init__(self) -> None:
        self.key: Any = None
        self.words: list[int] = []
        self.layout: wire.Layout = []
        self.total = 0
        self.hw = 0
        self.seq = 0
        self.peer_total = wire.INITIAL_TOTAL  # what the receiver will post next
        self.peer_hw = wire.INITIAL_WORDS


class _RecvState:
    __slots__ = ("total", "hw", "seq", "words", "form", "structure", "layout", "last")

    def __init__(self) -> None:
        self.total = wire.INITIAL_TOTAL
        self.hw = wire.INITIAL_WORDS
        self.seq = 0
        self.words: list[int] | None = None
        self.form = wire.SINGLE
        self.structure: Structure | None = None
        self.layout: wire.Layout = []
        self.last: RecvHandle | None = None


class Messenger:
    """Sends and receives payloads between the ranks of a process group.

    Why not plain ``dist.isend``: a receiver must know the size of what comes, stages pass tuples,
    the last microbatch may be smaller, and a rank waiting forever on a dead peer is the worst
    failure of a pipeline. A messenger sends any tensor, tuple of tensors, or nesting of tuples,
    lists and dicts of tensors (:mod:`pipetrain.structure`) as **one message**: a small header
    (sequence number, a user tag such as the microbatch, a few user integers, dtypes and shapes,
    the structure of a structured payload) followed by the tensor bytes. Sender and receiver track, per channel, the size of
    the next message; only when it changes does the sender first send a short control message
    announcing the new size (two messages once, then one again). Every wait has a timeout and
    turns gloo's errors into a :class:`~pipetrain.runtime.errors.PeerTimeoutError` or
    :class:`~pipetrain.runtime.errors.PeerLostError` that names what was being waited for.

    The wire format is in :mod:`pipetrain.runtime.wire`. The receiver's buffers are returned as
    views, without a copy; the sender copies once, into the message.

    Channels are (peer, kind): each kind (``"act"``, ``"grad"``, ``"labels"`` or any string) is a
    separate gloo tag, so receives of different kinds from the same peer may be posted in any
    order. (NCCL ignores tags: there, the order of posting must match between the two ranks.)
    Messages of one channel arrive in the order they were sent; a second ``irecv`` on a channel
    whose previous receive is still pending is posted when it is waited on, after the previous one
    completes. Handles cannot be polled: gloo reports a point-to-point transfer complete only once
    it has been waited on, and a wait that times out closes the connection, so an executor waits
    in program order. One thread per messenger.

    ``timeout`` (seconds) bounds every wait unless the wait names its own. ``status`` is an
    optional :class:`~pipetrain.runtime.status.StatusBoard`: the messenger tells it what it is
    waiting for, and appends its report of every rank to communication errors. ``device`` is where
    received tensors are allocated (CPU for gloo, the rank's GPU for NCCL).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float = 300.0,
        device: torch.device | str = "cpu",
        status: _Status | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise PipetrainError(
                "torch.distributed is not initialized: call pipetrain.runtime.launch.init_distributed() "
                "in each worker before creating a Messenger"
            )
        if timeout <= 0:
            raise PipetrainError(f"timeout must be positive seconds, got {timeout}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank()
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.status = status
        self._channels: dict[tuple[int, str], Channel] = {}

    def channel(self, peer: int, kind: str) -> Channel:
        """The channel to/from global rank ``peer`` for messages of ``kind`` (created once)."""
        key = (peer, kind)
        ch = self._channels.get(key)
        if ch is None:
            if peer == self.rank:
                raise PipetrainError(f"rank {self.rank} cannot open a channel to itself ({kind!r})")
            ch = self._channels[key] = Channel(self, peer, kind)
        return ch

    def isend(
        self,
        payload: Payload,
        peer: int,
        kind: str,
        *,
        tag: int = -1,
        info: Sequence[int] = (),
        what: object = None,
    ) -> SendHandle:
        """Start sending ``payload`` to ``peer``; see :meth:`Channel.isend`."""
        return self.channel(peer, kind).isend(payload, tag=tag, info=info, what=what)

    def irecv(
        self, peer: int, kind: str, *, what: object = None, expect_tag: int | None = None
    ) -> RecvHandle:
        """Start receiving the next payload of ``kind`` from ``peer``; see :meth:`Channel.irecv`."""
        return self.channel(peer, kind).irecv(what=what, expect_tag=expect_tag)

    def send(self, payload: Payload, peer: int, kind: str, **kwargs: Any) -> None:
        """Blocking :meth:`isend`."""
        self.isend(payload, peer, kind, **kwargs).wait()

    def recv(self, peer: int, kind: str, **kwargs: Any) -> Payload:
        """Blocking :meth:`irecv`."""
        return self.irecv(peer, kind, **kwargs).wait()

    def guard(self, work: Any, what: object, timeout: float | None = None) -> None:
        """Wait on any torch.distributed work (an ``all_reduce(..., async_op=True)`` of a SYNC,
        say) with this messenger's timeout, status and error messages."""
        status = self.status
        if status is not None:
            status.waiting = what
            status.peer = None
        seconds = self.timeout if timeout is None else timeout
        try:
            work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as error:  # the wait stays on the board (see Channel._wait)
            raise self._fail(error, str(what), None, seconds) from None
        if status is not None:
            status.waiting = None

    # -- errors -----------------------------------------------------------------------------------

    def _fail(self, error: RuntimeError, what: str, peer: int | None, timeout: float) -> CommunicationError:
        text = str(error)
        low = text.lower()
        other = "a peer" if peer is None else f"rank {peer}"
        if "closure" in low:
            exc: CommunicationError = CommunicationError(
                f"rank {self.rank} cannot complete {what}: the connection to {other} was closed "
                "after an earlier timeout"
            )
        elif "timed out" in low or "timeout" in low:
            exc = PeerTimeoutError(
                f"rank {self.rank} timed out after {timeout:g} s waiting for {what}: {other} "
                "hangs, is slower than the timeout, or its program never reaches the matching "
                f"action (raise {option('timeout')} only if it is merely slow)"
            )
        elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
            exc = PeerLostError(
                f"rank {self.rank} lost {other} while waiting for {what}: the peer process "
                "died or exited early (its own output says why)"
            )
        else:
            exc = CommunicationError(f"rank {self.rank} failed {what} with {other}: {text}")
        if self.status is not None:
            gone = {peer: "is gone (its connection closed)"} if isinstance(exc, PeerLostError) and peer is not None else None
            try:
                exc.args = (f"{exc.args[0]}\n{self.status.report(gone=gone)}",)
            except Exception:  # the report is a courtesy; never mask the real error
                pass
        return exc


class Channel:
    """One direction-agnostic stream of messages of one kind between this rank and ``peer``."""

    __slots__ = ("messenger", "peer", "kind", "_pg", "_group_peer", "_tag", "_send", "_recv", "_td")

    def __init__(self, messenger: Messenger, peer: int, kind: str) -> None:
        self.messenger = messenger
        self.peer = peer
        self.kind = kind
        self._pg = messenger.group
        self._group_peer = (
            peer if messenger.group is dist.group.WORLD else dist.get_group_rank(messenger.group, peer)
        )
        self._tag = _tag_of(kind)
        self._send = _SendState()
        self._recv = _RecvState()
        self._td = datetime.timedelta(seconds=messenger.timeout)

    def __repr__(self) -> str:
        return f"Channel(rank {self.messenger.rank} <-> rank {self.peer}, {self.kind!r})"

    def isend(
        self, payload: Payload, *, tag: int = -1, info: Sequence[int] = (), what: object = None
    ) -> SendHandle:
        """Start sending ``payload`` (a tensor, a tuple of tensors, or tuples, lists and dicts of tensors
        nested in any way; tensors of any dtypes and shapes). The receiver gets back the same structure.

        ``tag`` (for example the microbatch) and up to :data:`MAX_INFO` integers ``info`` travel
        in the header; the receiver reads them from its handle. ``what`` describes the action for
        error messages (any object; ``str()`` is taken only on error). The tensors may be reused
        as soon as this returns: they were copied into the message.
        """
        tensors, single, structure = _normalize(payload)
        st = self._send
        key = (structure or single, [(t.dtype, t.shape) for t in tensors])
        if key != st.key:
            words = wire.meta_words(tensors, single, structure)
            st.layout = wire.parse_meta(words)[2]
            st.key, st.words, st.hw = key, words, wire.PREFIX + len(words)
            st.total = st.layout[-1][2] + wire.padded(st.layout[-1][3]) if st.layout else st.hw * 8
        ninfo = len(info)
        if ninfo > MAX_INFO:
            raise PipetrainError(f"a message carries at most {MAX_INFO} info integers, got {ninfo}")
        device = self.messenger.device  # the transport's buffers (wire.pack copies each tensor there)
        seq = st.seq
        st.seq = seq + 1
        works = []
        buffers = []
        if st.total != st.peer_total or st.hw != st.peer_hw:
            control = torch.zeros(st.peer_total, dtype=torch.uint8, device=device)
            control[:32].view(torch.int64).copy_(
                torch.tensor([wire.CONTROL, seq, st.total, st.hw], dtype=torch.int64)
            )
            buffers.append(control)
            works.append(self._pg.send([control], self._group_peer, self._tag))
            st.peer_total, st.peer_hw = st.total, st.hw
        header = [wire.DATA, seq, st.total, st.hw, tag, ninfo, *info, *wire.ZEROS[ninfo:], *st.words]
        message = wire.pack(header, tensors, st.layout, st.total, device)
        buffers.append(message)
        try:
            works.append(self._pg.send([message], self._group_peer, self._tag))
        except RuntimeError as error:
            raise self.messenger._fail(error, self._what(what, True), self.peer, self.messenger.timeout) from None
        return SendHandle(self, works, buffers, what)

    def irecv(self, *, what: object = None, expect_tag: int | None = None) -> RecvHandle:
        """Start receiving the next payload of this channel; ``wait()`` on the handle returns it.

        ``what`` describes the action for error messages (for example ``"RECV_F of microbatch 3
        from rank 0"``, or the action object itself). With ``expect_tag``, a message with another
        tag raises :class:`~pipetrain.runtime.errors.ProtocolError` (the programs disagree).
        """
        handle = RecvHandle(self, what, expect_tag)
        last = self._recv.last
        if last is None or last._result is not None:
            handle._post()
        else:
            handle._prev = last
        self._recv.last = handle
        return handle

    def _what(self, what: object, sending: bool) -> str:
        if what is not None:
            return str(what)
        if sending:
            return f"send of {self.kind!r} to rank {self.peer}"
        return f"receive of {self.kind!r} from rank {self.peer}"

    def _wait(self, work: Any, what: object, sending: bool, timeout: float | None) -> None:
        messenger = self.messenger
        status = messenger.status
        if status is not None:
            status.waiting = what if what is not None else self._what(None, sending)
            status.peer = self.peer
        try:
            work.wait(self._td if timeout is None else datetime.timedelta(seconds=timeout))
        except RuntimeError as error:
            # the wait stays on the board: the last record of a rank that gave up names what it waited
            # for, so that the launcher counts it among the waiters of the rank that stopped
            seconds = messenger.timeout if timeout is None else timeout
            raise messenger._fail(error, self._what(what, sending), self.peer, seconds) from None
        if status is not None:
            status.waiting = None


class SendHandle:
    """A send in flight. ``wait()`` before relying on the peer having received it."""

    __slots__ = ("channel", "_works", "_buffers", "what", "_error")

    def __init__(self, channel: Channel, works: list[Any], buffers: list[torch.Tensor], what: object):
        self.channel = channel
        self._works = works
        self._buffers = buffers  # kept alive until the send completes
        self.what = what
        self._error: CommunicationError | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until sent (gloo: until the receiver posted its receive); each message waits up
        to ``timeout`` seconds (default: the messenger's)."""
        if self._error is not None:
            raise self._error
        # A gloo work must be waited on once only (a second wait never returns): take them out first.
        works, self._works = self._works, []
        try:
            for work in works:
                self.channel._wait(work, self.what, True, timeout)
        except CommunicationError as error:
            self._error = error
            raise
        self._buffers = []


class RecvHandle:
    """A receive in flight. ``wait()`` returns the payload; ``tag`` and ``info`` are then set."""

    __slots__ = ("channel", "what", "expect_tag", "tag", "info", "_work", "_buffer", "_prev", "_result", "_error")

    def __init__(self, channel: Channel, what: object, expect_tag: int | None) -> None:
        self.channel = channel
        self.what = what
        self.expect_tag = expect_tag
        self.tag = -1
        self.info: tuple[int, ...] = ()
        self._work: Any = None
        self._buffer: torch.Tensor | None = None
        self._prev: RecvHandle | None = None
        self._result: Payload | None = None
        self._error: CommunicationError | None = None

    def _post(self) -> None:
        ch = self.channel
        self._buffer = torch.empty(ch._recv.total, dtype=torch.uint8, device=ch.messenger.device)
        try:
            self._work = ch._pg.recv([self._buffer], ch._group_peer, ch._tag)
        except RuntimeError as error:
            raise ch.messenger._fail(error, ch._what(self.what, False), ch.peer, ch.messenger.timeout) from None

    def wait(self, timeout: float | None = None) -> Payload:
        """Block until the payload arrived and return it (a tensor, a tuple, or the structure that was
        sent); each message waits up to ``timeout`` seconds (default: the messenger's)."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._finish(timeout)
            except CommunicationError as error:  # never wait on the same gloo work twice
                self._error = error
                raise
            if self._error is not None:
                raise self._error
        return self._result  # type: ignore[return-value]

    def _finish(self, timeout: float | None) -> None:
        if self._result is not None:
            return
        if self._error is not None:
            raise self._error
        ch = self.channel
        st = ch._recv
        if self._prev is not None:
            prev, self._prev = self._prev, None
            try:
                prev._finish(timeout)
            except CommunicationError as error:
                prev._error = error
                raise
            self._post()
        ch._wait(self._work, self.what, False, timeout)
        buffer = self._buffer
        assert buffer is not None
        array = buffer.numpy() if buffer.device == wire.CPU else None
        words = wire.header_words(buffer, array, st.hw)
        if words[0] == wire.CONTROL:
            self._check_seq(words[1])
            st.total, st.hw = words[2], words[3]
            self._post()
            ch._wait(self._work, self.what, False, timeout)
            buffer = self._buffer
            array = buffer.numpy() if buffer.device == wire.CPU else None
            words = wire.header_words(buffer, array, st.hw)
        if words[0] != wire.DATA:
            raise ProtocolError(
                f"rank {ch.messenger.rank} received a message it cannot read during "
                f"{ch._what(self.what, False)}: both ranks must use pipetrain's Messenger on channel "
                f"{ch.kind!r} and agree on what they send"
            )
        self._check_seq(words[1])
        st.seq += 1
        self.tag = words[4]
        if words[5]:
            self.info = tuple(words[6 : 6 + words[5]])
        meta = words[wire.PREFIX:]
        if meta != st.words:
            st.form, text, st.layout = wire.parse_meta(meta)
            st.structure = None if text is None else Structure.parse(text)
            st.words = meta
        tensors = wire.unpack(buffer, array, st.layout)
        form = st.form
        self._result = tensors[0] if form == wire.SINGLE else tensors if form == wire.TUPLE else st.structure.unflatten(tensors)
        self._buffer = None
        self._work = None
        if self.expect_tag is not None and self.tag != self.expect_tag:
            self._error = ProtocolError(
                f"rank {ch.messenger.rank} expected tag {self.expect_tag} during "
                f"{ch._what(self.what, False)} but rank {ch.peer} sent tag {self.tag}: the programs "
                "of the two ranks disagree on the order of their messages"
            )

    def _check_seq(self, seq: int) -> None:
        st = self.channel._recv
        if seq != st.seq:
            ch = self.channel
            raise ProtocolError(
                f"rank {ch.messenger.rank} expected message {st.seq} of channel {ch.kind!r} from "
                f"rank {ch.peer} during {ch._what(self.what, False)}, got message {seq}"
            )
