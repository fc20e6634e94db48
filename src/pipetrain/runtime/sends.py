"""Completing sends: waited for once the receiver must have taken them, or at the next receive.

A gloo send completes only when the receiver has received it, and its work cannot be polled.
Waiting for a send right away could block a rank on a peer that is itself waiting for this rank;
never waiting would keep every message buffer alive. The programs say when waiting is free: when
this rank receives a message that peer P sent at position ``s`` of P's program, P has already run
every action before ``s``, including the receive of each of our sends whose RECV sits before ``s``.
Those sends are complete (or completing), so the ledger waits for them then; what remains is
waited for at the end of the program.

When receives are posted on demand (:func:`on_demand_is_safe`), a rank waits after each receive
for its sends to that peer that the peer takes before it sends its next message (much as
torch.distributed.pipelining waits for its sends and receives together): those transfers happen
while the rank is blocked anyway, instead of interrupting its computation. It used to wait for
every open send there, but that holds a rank until its peer reaches the receive of each of them:
with a warm-up deeper than 1F1B's (zb-h2 at 2 stages) the two ranks ran in lock-step, 0.58x of
receives posted ahead. The dry run of :func:`on_demand_is_safe` still assumes the old waits: every
wait the ledger makes now is one it made then, so what it proves safe stays safe.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from pipetrain.schedule.ir import Kind, Schedule
from pipetrain.schedule.messages import Messages
from pipetrain.schedule.pattern import pattern_of

__all__ = ["SendLedger", "on_demand_is_safe", "splits_backward"]

_RECEIVES = (Kind.RECV_F, Kind.RECV_B)
#: actions read ahead for the next receive from a peer (:meth:`SendLedger.received_on_demand`)
_LOOKAHEAD = 256


class SendLedger:
    """Send handles of one rank, waited for as soon as the schedule proves them received."""

    def __init__(self, schedule: Schedule, rank: int, messages: Messages | None = None) -> None:
        self._messages = Messages(schedule) if messages is None else messages
        self._program = schedule.programs[rank]
        self._pending: dict[int, list[tuple[int, Any]]] = {}  # peer -> [(receive position, handle)]

    def sent(self, position: int, peer: int, handle: Any) -> None:
        """Our SEND at ``position`` is under way."""
        receive_position = self._messages.received_at[Messages.of(self._program[position])][1]
        self._pending.setdefault(peer, []).append((receive_position, handle))

    def received(self, position: int, peer: int) -> None:
        """Our RECV at ``position`` from ``peer`` completed: wait for the sends it proves received."""
        if self._pending.get(peer):
            self._complete(peer, self._messages.sent_at[Messages.of(self._program[position])][1])

    def received_on_demand(self, position: int, peer: int, before: Sequence[int] | None = None) -> None:
        """Our RECV at ``position`` from ``peer``, posted on demand, completed: wait for our sends to
        ``peer`` that it receives before it sends us its next message (and before its next pause,
        ``before``). The peer takes those without waiting for this rank; the sends it receives
        later are left open: waiting for them would hold this rank until the peer gets there, and
        a warm-up deeper than 1F1B's (zb-h2's) would run in lock-step."""
        if not self._pending.get(peer):
            return
        limit = self._next_sent_by(peer, position)
        if before is not None:
            limit = min(limit, before[peer])
        self._complete(peer, limit)

    def _next_sent_by(self, peer: int, position: int) -> float:
        """Where in ``peer``'s program the message of our next RECV from it after ``position`` is
        sent; infinity (wait for every open send, the rule of old) when there is none within
        :data:`_LOOKAHEAD` actions, so that a long program is never read far ahead."""
        program = self._program
        for later in range(position + 1, min(position + 1 + _LOOKAHEAD, len(program))):
            action = program[later]
            key = Messages.of(action) if action.kind in _RECEIVES else None
            if key is not None:
                sender, at = self._messages.sent_at[key]
                if sender == peer:
                    return at
        return math.inf

    def drain(self, before: Sequence[int] | None = None) -> None:
        """Wait for every send still under way (end of the program), or with ``before`` (each
        rank's position of the next pause) for those its receiver takes before that pause."""
        for peer in list(self._pending):
            self._complete(peer, math.inf if before is None else before[peer])

    def _complete(self, peer: int, limit: float) -> None:
        """Wait for our sends to ``peer`` whose receive sits before ``limit`` in its program."""
        still = []
        for receive_position, handle in self._pending[peer]:
            if receive_position < limit:
                handle.wait()
            else:
                still.append((receive_position, handle))
        self._pending[peer] = still


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits backwards into I and W (the zero-bubble family). ``auto`` keeps
    such a schedule's receives posted ahead: on demand, its W work between receives delays each
    receive its peer's message waits for, and on a CPU it ran 1.27-1.42x slower (zb-h1, zb-h2 and
    interleaved-zb at 2 workers, overhead-bound: benchmarks/RESULTS.md section 21)."""
    pattern = pattern_of(schedule)
    programs = pattern.sample.programs if pattern is not None else schedule.programs
    return any(action.kind is Kind.W for program in programs for action in program)


def on_demand_is_safe(
    schedule: Schedule,
    messages: Messages | None = None,
    pauses: Sequence[Sequence[int]] = (),
    start: Any = None,
) -> bool:
    """Whether every rank may post each receive only when it reaches it and wait there for all its
    earlier sends, without any rank waiting forever.

    A dry run of all programs under those rules: a SEND never blocks; a RECV proceeds once its
    message was sent and every send of this rank still open has a receiver that arrived at the
    matching RECV (a receiver there takes the message: it was sent, and the receiver waits for
    its receive before its own sends); a SYNC proceeds once every replica of the stage arrived at
    the same SYNC; the end of a program waits for the open sends. Schedules this refuses keep
    their receives posted ahead (which never blocks on a send). ``messages``: the schedule's
    :class:`Messages`, if already built.

    ``pauses`` lists the cuts where every rank stops together (evaluation, checkpoints) as each
    rank's program position, in program order: no rank goes past its position of a pause before
    every rank has reached its own. A send that crosses a pause (received after the receiver's
    position of it) is not waited for before the sender has passed that pause
    (:meth:`SendLedger.drain` with ``before``).

    ``start``: a resumed run's :class:`~pipetrain.schedule.cuts.Cut`; every rank begins at its
    position, with the messages that crossed the cut sent again and still open.

    A long schedule expanded from a pattern is dry-run as its sample, with the pauses and the
    start moved to the same places of the sample (the pattern repeats, so the dry run does too).
    """
    pattern = pattern_of(schedule)
    if pattern is not None:
        moved = _to_sample(pattern, pauses, start)
        if moved is None:
            return False
        sample_pauses, sample_start = moved
        return on_demand_is_safe(pattern.sample, None, sample_pauses, sample_start)
    programs = schedule.programs
    messages = Messages(schedule) if messages is None else messages
    ranks = range(len(programs))
    pcs = [0] * len(programs) if start is None else list(start.positions)
    posted = [False] * len(programs)  # stopped at a RECV it has posted (not at a pause before it)
    passed = [0] * len(programs)  # pauses each rank has gone past
    open_sends: list[list[tuple[int, int]]] = [
        [] if start is None else [messages.received_at[Messages.of(program[p])] for p in start.crossing_sends[rank]]
        for rank, program in enumerate(programs)
    ]
    sync_count: dict[tuple[int, int], int] = {}  # (rank, stage) -> SYNCs done
    sync_arrived: dict[tuple[int, int], int] = {}  # (stage, occurrence) -> replicas arrived
    arrived_at_sync: set[tuple[int, int]] = set()  # (rank, position) counted in sync_arrived

    def taken(peer: int, position: int) -> bool:
        return pcs[peer] > position or (pcs[peer] == position and posted[peer])

    def due(rank: int) -> list[tuple[int, int]]:
        """The open sends of ``rank`` that must complete before its next pause."""
        limits = pauses[passed[rank]] if passed[rank] < len(pauses) else None
        return [(peer, position) for peer, position in open_sends[rank] if limits is None or position < limits[peer]]

    def sends_taken(rank: int) -> bool:
        return all(taken(peer, position) for peer, position in due(rank))

    def pause_complete(index: int) -> bool:
        return all(passed[q] > index or (passed[q] == index and pcs[q] == pauses[index][q]) for q in ranks)

    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            pc = pcs[rank]
            while True:
                posted[rank] = False
                while passed[rank] < len(pauses) and pauses[passed[rank]][rank] == pc:
                    pcs[rank] = pc  # arrived
                    if not pause_complete(passed[rank]):
                        break
                    passed[rank] += 1
                    progress = True
                if passed[rank] < len(pauses) and pauses[passed[rank]][rank] == pc or pc == len(program):
                    break
                action = program[pc]
                kind = action.kind
                if kind is Kind.SEND_F or kind is Kind.SEND_B:
                    open_sends[rank].append(messages.received_at[Messages.of(action)])
                elif kind is Kind.RECV_F or kind is Kind.RECV_B:
                    pcs[rank] = pc  # posted: peers waiting for their sends to us may go on
                    posted[rank] = True
                    sender, position = messages.sent_at[Messages.of(action)]
                    if pcs[sender] <= position or not sends_taken(rank):
                        break
                    done = set(due(rank))
                    open_sends[rank] = [send for send in open_sends[rank] if send not in done]
                elif kind is Kind.SYNC:
                    replicas = len(schedule.stage_ranks[action.stage])
                    if replicas > 1:
                        occurrence = (action.stage, sync_count.get((rank, action.stage), 0))
                        if (rank, pc) not in arrived_at_sync:
                            arrived_at_sync.add((rank, pc))
                            sync_arrived[occurrence] = sync_arrived.get(occurrence, 0) + 1
                        if sync_arrived[occurrence] < replicas:
                            break
                        sync_count[(rank, action.stage)] = occurrence[1] + 1
                pc += 1
                progress = True
            pcs[rank] = pc
    return all(
        pcs[r] == len(p) and passed[r] == len(pauses) and all(taken(q, position) for q, position in open_sends[r])
        for r, p in enumerate(programs)
    )


def _to_sample(pattern: Any, pauses: Sequence[Sequence[int]], start: Any) -> tuple[list[list[int]], Any] | None:
    """Pauses and a resumed cut of a long schedule at the same places of its pattern's sample
    (None if one falls outside it)."""
    sample = pattern.sample.programs
    lengths = [program._l for program in pattern.programs]

    def move(positions: Sequence[int]) -> tuple[list[int], int] | None:
        shift = pattern.shift_of_position(0, positions[0])
        moved = [p - shift * lengths[r] for r, p in enumerate(positions)]
        if any(not 0 <= p <= len(sample[r]) for r, p in enumerate(moved)):
            return None
        return moved, shift

    seen: set[tuple[int, ...]] = set()
    for pause in pauses:
        found = move(pause)
        if found is None:
            return None
        seen.add(tuple(found[0]))
    moved_pauses = [list(pause) for pause in sorted(seen)]
    moved_start = None
    if start is not None:
        found = move(start.positions)
        if found is None:
            return None
        moved_start = start.shifted(pattern, -found[1])
    return moved_pauses, moved_start
