"""The runtime's transport: one rank's messages and collectives over torch.distributed.

It is the :class:`~pipetrain.execution.interpreter.Transport` of a
:class:`~pipetrain.runtime.rank_runner.RankRunner`'s interpreter. Activations travel with the
labels of their microbatch appended (one message per boundary, not two) and the count of inputs
needing no gradient in the message's info; gradients travel without their None entries, a mask in
the info saying where they were. Every message goes through the
:class:`~pipetrain.runtime.p2p.Messenger` (one channel per receiving stage and direction, bounded
waits, the failure report naming the action); sends are completed by a
:class:`~pipetrain.runtime.sends.SendLedger`. Receives are posted on demand or ahead of need (see
:mod:`pipetrain.runtime.rank_runner`). Every wait blocks: this transport never answers
:data:`~pipetrain.execution.interpreter.WAIT`.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Sequence

import torch
import torch.distributed as dist

from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.tied_gradients import TiedGradients, gradient_of
from pipetrain.runtime.p2p import Messenger, RecvHandle
from pipetrain.runtime.sends import SendLedger, on_demand_is_safe, splits_backward
from pipetrain.schedule.ir import Action, Kind, Schedule, format_action
from pipetrain.schedule.messages import Messages
from pipetrain.schedule.pattern import PeriodicProgram
from pipetrain.structure import append, split_last

__all__ = ["DistributedTransport"]

_RECV_F, _RECV_B = Kind.RECV_F, Kind.RECV_B


class _Waiting:
    """What a rank is waiting for, described lazily for error messages and the status board."""

    __slots__ = ("action", "peer")

    def __init__(self, action: Action, peer: int | None) -> None:
        self.action, self.peer = action, peer

    def __str__(self) -> str:
        text = format_action(self.action)
        return f"{text} (from rank {self.peer})" if self.peer is not None else text


class DistributedTransport:
    """The messages and collectives of ``rank`` (a :class:`~pipetrain.execution.interpreter.Transport`).

    Args:
        executors: ``{stage: StageExecutor}`` of this rank (SYNC and shared parameters read them).
        messenger: point-to-point messages; ``groups``: the process groups of
            :func:`~pipetrain.runtime.rank_runner.sync_groups`.
        messages: the schedule's :class:`~pipetrain.schedule.messages.Messages`.
        tied: where the stages sharing a parameter sum its gradient.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        executors: dict[int, StageExecutor],
        messenger: Messenger,
        groups: dict[Any, Any],
        messages: Messages,
        tied: TiedGradients | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.executors = executors
        self.messenger = messenger
        self.groups = groups
        self.messages = messages
        self.tied = tied if tied else None
        self.program = schedule.programs[rank]
        self.sends = SendLedger(schedule, rank, messages)
        self.on_demand = False
        self._posted: dict[tuple[int, str], RecvHandle] = {}
        self._queues: dict[tuple[int, str], deque] = {}
        self._pauses: Any = []  # every rank's position of each cut where all pause
        self._next_pause = 0

    # -- the cuts where all ranks pause ----------------------------------------------------------

    def begin(self, receives: str, hooks: dict, pauses: Any, start: int, resumed_cut: Any) -> int:
        """Choose how receives are posted for a run from ``start`` (see :meth:`choose_receives`);
        returns this rank's position of the first pause (-1: none)."""
        self._pauses = pauses
        self._next_pause = 0
        self.choose_receives(receives, hooks, start, resumed_cut)
        return self._pauses[0][self.rank] if self._pauses else -1

    def upcoming(self) -> list[int] | None:
        """Every rank's position of the next pause this rank has not passed (None: no more)."""
        return self._pauses[self._next_pause] if self._next_pause < len(self._pauses) else None

    def pass_pauses(self, position: int) -> int:
        """This rank has run its hooks at ``position``: the pauses there are behind it. Returns its
        position of the next pause (-1 when none is left)."""
        upcoming = self.upcoming()
        while upcoming is not None and upcoming[self.rank] == position:
            self._next_pause += 1
            upcoming = self.upcoming()
        return -1 if upcoming is None else upcoming[self.rank]

    def drain(self) -> None:
        """Complete every send (at the end of the program)."""
        self.sends.drain()

    # -- receives posted ahead of need ----------------------------------------------------------

    def choose_receives(self, receives: str, hooks: dict, start: int, resumed_cut: Any) -> None:
        """On demand when asked, or under ``auto`` when the dry run proves it safe for this run
        (from the start or the resumed cut, with these pauses) and the schedule does not split its
        backwards (:func:`~pipetrain.runtime.sends.splits_backward`: measured slower on demand). A
        hook that is not one of the pauses (all ranks stopping together at a cut) could block this
        rank while a peer waits for it to take a send: it keeps the receives posted ahead."""
        if receives == "on-demand":
            self.on_demand = True
        elif receives == "auto":
            wanted = set(hooks)
            known = {pause[self.rank] for pause in self._pauses if pause[self.rank] in wanted}
            self.on_demand = (not splits_backward(self.schedule)
                              and all(position in known for position in hooks)
                              and on_demand_is_safe(self.schedule, self.messages, self._pauses, start=resumed_cut))
        if not self.on_demand:
            self._plan_receives(start)

    def _plan_receives(self, start: int) -> None:
        """Queue the receives of the program from ``start`` on per channel, in program order, and
        post the first of each channel. The program is read as far as the receives posted need
        (a long program is never listed whole): each channel's queue holds the receives read but
        not yet posted."""
        self._scan = start
        self._left = self._receive_counts(start)
        while any(left and channel not in self._queues for channel, left in self._left.items()):
            self._scan_one()
        for channel in list(self._queues):
            self._post_next(channel)

    def _channel(self, action: Action) -> tuple[int, str]:
        return (self.schedule.peer_of(action), ("act" if action.kind is _RECV_F else "grad") + str(action.stage))

    def _receive_counts(self, start: int) -> dict[tuple[int, str], int]:
        """Per channel, the receives of the program at positions ``start`` on."""
        program, counts = self.program, {}

        def add(actions, times: int) -> None:
            for action in actions:
                kind = action.kind
                if kind is _RECV_F or kind is _RECV_B:
                    channel = self._channel(action)
                    counts[channel] = counts.get(channel, 0) + times

        if isinstance(program, PeriodicProgram):  # routing repeats with the period: count the pattern
            add(program.head, 1)
            add(program.body, program.copies)
            add(program.tail, 1)
            add(islice(program, start), -1)
        else:
            add(islice(program, start, None), 1)
        return counts

    def _scan_one(self) -> None:
        action = self.program[self._scan]
        self._scan += 1
        kind = action.kind
        if kind is _RECV_F or kind is _RECV_B:
            channel = self._channel(action)
            self._queues.setdefault(channel, deque()).append(action)
            self._left[channel] -= 1

    def _post_next(self, channel: tuple[int, str]) -> None:
        queue = self._queues[channel]
        while not queue and self._left.get(channel, 0) > 0:
            self._scan_one()
        if queue:
            action = queue.popleft()
            self._posted[channel] = self.messenger.irecv(
                channel[0], channel[1], what=_Waiting(action, channel[0]), expect_tag=action.microbatch
            )

    def _receive(self, channel: tuple[int, str], position: int):
        if self.on_demand:
            action = self.program[position]
            handle = self.messenger.irecv(
                channel[0], channel[1], what=_Waiting(action, channel[0]), expect_tag=action.microbatch
            )
            payload = handle.wait()
            # after the receive: the sends the peer takes before its next message to this rank
            self.sends.received_on_demand(position, channel[0], self.upcoming())
            return payload, handle
        handle = self._posted.pop(channel)
        payload = handle.wait()
        self._post_next(channel)
        self.sends.received(position, channel[0])
        return payload, handle

    def _send(self, payload, peer: int, kind: str, microbatch: int, action: Action, position: int, info=()) -> None:
        handle = self.messenger.isend(payload, peer, kind, tag=microbatch, info=info, what=_Waiting(action, None))
        self.sends.sent(position, peer, handle)

    # -- the Transport ---------------------------------------------------------------------------

    def send_activations(self, action: Action, position: int, payload: Any, labels: Any, constants: int) -> None:
        self._send(append(payload, labels), self.schedule.peer_of(action), "act" + str(action.stage + 1),
                   action.microbatch, action, position, info=(constants,) if constants else ())

    def receive_activations(self, action: Action, position: int) -> Any:
        payload, handle = self._receive((self.schedule.peer_of(action), "act" + str(action.stage)), position)
        inputs, labels = split_last(payload)
        return inputs, labels, handle.info[0] if handle.info else 0

    def send_gradients(self, action: Action, position: int, grads: Sequence[Any]) -> None:
        mask = sum(1 << i for i, g in enumerate(grads) if g is not None)
        present = tuple(g for g in grads if g is not None)
        self._send(present, self.schedule.peer_of(action), "grad" + str(action.stage - 1), action.microbatch, action,
                   position, info=(mask,))

    def receive_gradients(self, action: Action, position: int) -> Any:
        payload, handle = self._receive((self.schedule.peer_of(action), "grad" + str(action.stage)), position)
        return _unmask(payload, handle.info[0] if handle.info else None)

    def all_reduce(self, stage: int) -> bool:
        """SYNC: sum the accumulated gradients and sample counts of the stage's replicas (and under
        float16 tell each whether any overflowed)."""
        executor = self.executors[stage]
        group = self.groups.get(stage)
        if group is None:
            return True
        names = sorted(executor.trainable)
        params = executor.versions.latest
        grads = executor.grads or {}
        parts = [grads[n] if n in grads else torch.zeros_like(params[n]) for n in names]
        flat = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0, device=executor.device)
        # the samples, and under float16 how many replicas' parts of the update overflowed
        counts = torch.tensor([executor.pending_samples, int(executor.overflowed)], dtype=torch.int64)
        dist.all_reduce(flat, group=group)
        dist.all_reduce(counts, group=group)
        executor.share_overflow(bool(counts[1]))
        total, offset = {}, 0
        for name, part in zip(names, parts):
            size = part.numel()
            total[name] = flat[offset: offset + size].view_as(part)
            offset += size
        executor.grads = total
        executor.pending_samples = int(counts[0])
        return True

    def sum_tied(self, position: int) -> bool:
        """Before a STEP: sum the gradients of the shared parameters due here. Each holder's part
        is broadcast from its first replica's rank, and every rank adds the parts in stage order."""
        if self.tied is None:
            return True
        tied, rank, first = self.tied, self.rank, self.schedule.stage_ranks
        for t, _ in tied.due(rank, position):
            group = self.groups.get(("tied", t))
            holders = dict(tied.tied[t].holders)
            mine = next(e for s, e in self.executors.items() if s in holders)
            like = mine.versions.latest[holders[mine.stage]]

            def part(stage: int, name: str, group: Any = group, like: torch.Tensor = like) -> torch.Tensor:
                source = first[stage][0]
                if source == rank:
                    value = gradient_of(self.executors[stage], name).contiguous()
                else:
                    value = torch.empty_like(like)
                if group is not None:
                    dist.broadcast(value, src=source, group=group)
                return value

            tied.assign(t, tied.total(t, part), self.executors.values())
        return True


def _unmask(payload, mask: int | None) -> tuple:
    values = payload if isinstance(payload, tuple) else (payload,)
    if mask is None:
        return values
    out, it = [], iter(values)
    position = 0
    while mask >> position:
        out.append(next(it) if (mask >> position) & 1 else None)
        position += 1
    return tuple(out)
