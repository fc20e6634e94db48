"""Completing sends without ever blocking on one: a send is waited for once its receiver must have
taken it.

A gloo send completes only when the receiver has received it, and its work cannot be polled.
Waiting for a send right away could block a rank on a peer that is itself waiting for this rank;
never waiting would keep every message buffer alive. The programs say when waiting is free: when
this rank receives a message that peer P sent at position ``s`` of P's program, P has already run
every action before ``s``, including the receive of each of our sends whose RECV sits before ``s``.
Those sends are complete (or completing), so the ledger waits for them then; what remains is
waited for at the end of the program.
"""

from __future__ import annotations

from typing import Any

from pipetrain.schedule.ir import Kind, Schedule

__all__ = ["SendLedger"]

_MATCH = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}


class SendLedger:
    """Send handles of one rank, waited for as soon as the schedule proves them received."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        receive_at: dict[tuple, int] = {}  # (kind, stage, microbatch) -> position in its rank's program
        send_at: dict[tuple, int] = {}
        for program in schedule.programs:
            for position, action in enumerate(program):
                kind = action.kind
                if kind is Kind.RECV_F or kind is Kind.RECV_B:
                    receive_at[(kind, action.stage, action.microbatch)] = position
                elif kind is Kind.SEND_F or kind is Kind.SEND_B:
                    send_at[(kind, action.stage, action.microbatch)] = position
        #: our SEND position -> where its receive sits in the peer's program
        self._receive_position: dict[int, int] = {}
        #: our RECV position -> where the matching send sits in the peer's program
        self._sent_at: dict[int, int] = {}
        for position, action in enumerate(schedule.programs[rank]):
            kind, stage, k = action.kind, action.stage, action.microbatch
            if kind is Kind.SEND_F:
                self._receive_position[position] = receive_at[(Kind.RECV_F, stage + 1, k)]
            elif kind is Kind.SEND_B:
                self._receive_position[position] = receive_at[(Kind.RECV_B, stage - 1, k)]
            elif kind is Kind.RECV_F:
                self._sent_at[position] = send_at[(Kind.SEND_F, stage - 1, k)]
            elif kind is Kind.RECV_B:
                self._sent_at[position] = send_at[(Kind.SEND_B, stage + 1, k)]
        self._pending: dict[int, list[tuple[int, Any]]] = {}  # peer -> [(receive position, handle)]

    def sent(self, position: int, peer: int, handle: Any) -> None:
        """Our SEND at ``position`` is under way."""
        self._pending.setdefault(peer, []).append((self._receive_position[position], handle))

    def received(self, position: int, peer: int) -> None:
        """Our RECV at ``position`` from ``peer`` completed: wait for the sends it proves received."""
        pending = self._pending.get(peer)
        if not pending:
            return
        horizon = self._sent_at[position]
        still = []
        for receive_position, handle in pending:
            if receive_position < horizon:
                handle.wait()
            else:
                still.append((receive_position, handle))
        self._pending[peer] = still

    def drain(self) -> None:
        """Wait for every send still under way (end of the program)."""
        for pending in self._pending.values():
            for _, handle in pending:
                handle.wait()
        self._pending.clear()
