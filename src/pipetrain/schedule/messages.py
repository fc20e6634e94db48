"""Where every point-to-point message of a schedule is sent and received (read off the programs)."""

from __future__ import annotations

from typing import Any

from pipetrain.schedule.ir import Kind, Schedule
from pipetrain.schedule.pattern import ShiftedEnds, pattern_of

__all__ = ["Messages"]


class Messages:
    """Where every point-to-point message of a schedule is sent and received.

    A message is named by its receive: ``(RECV_F or RECV_B, receiving stage, microbatch)``;
    ``sent_at[message]`` and ``received_at[message]`` are ``(rank, program position)``.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.sent_at: dict[tuple, tuple[int, int]] = {}
        self.received_at: dict[tuple, tuple[int, int]] = {}
        pattern = pattern_of(schedule)
        if pattern is not None:  # a long schedule: its sample's table, shifted (no table of every message)
            sample = pattern.cached("messages", lambda: Messages(pattern.sample))
            self.sent_at = ShiftedEnds(pattern, sample.sent_at)  # type: ignore[assignment]
            self.received_at = ShiftedEnds(pattern, sample.received_at)  # type: ignore[assignment]
            return
        for rank, program in enumerate(schedule.programs):
            for position, action in enumerate(program):
                message = self.of(action)
                if message is not None:
                    ends = self.received_at if message[0] is action.kind else self.sent_at
                    ends[message] = (rank, position)

    @staticmethod
    def of(action: Any) -> tuple | None:
        """The message a SEND or RECV action moves (None for other actions)."""
        kind = action.kind
        if kind is Kind.RECV_F or kind is Kind.RECV_B:
            return (kind, action.stage, action.microbatch)
        if kind is Kind.SEND_F:
            return (Kind.RECV_F, action.stage + 1, action.microbatch)
        if kind is Kind.SEND_B:
            return (Kind.RECV_B, action.stage - 1, action.microbatch)
        return None
