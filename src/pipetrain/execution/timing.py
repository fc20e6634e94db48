"""Measured action times in bounded form: every action of a short program, a window of a long one.

A run of 100,000 updates runs about half a million actions per rank; keeping a start and an end for
each would grow with the run. A rank records the start and end of its first :data:`WINDOW` actions
(all of them in a shorter program: the measured timeline, traces and plots are then exactly as
before) and, beyond that, only what the report needs of the whole run: its busy time (F, B, I, W,
STEP) and the end of each update of the last stage.
"""

from __future__ import annotations

from array import array
from dataclasses import replace
from typing import Sequence

from pipetrain.errors import PipetrainError
from pipetrain.schedule.cuts import cuts
from pipetrain.schedule.ir import Action, Kind
from pipetrain.schedule.timeline import Timeline

__all__ = ["ActionTimes", "WINDOW", "window_lengths", "measured_timeline"]

#: actions per rank timed one by one (the window of a long run's measured timeline): about a thousand
#: PipeDream updates; rank 0 holds every rank's window as actions at the end, so it stays small
WINDOW = 5_000

_BUSY = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB, Kind.STEP})


def window_lengths(schedule, units_per_update: int = 1) -> list[int]:
    """Per rank, the actions timed one by one: every action of programs of at most :data:`WINDOW`
    actions; else the actions before a consistent cut (:mod:`~pipetrain.schedule.cuts`) within
    :data:`WINDOW` actions of every rank, so that the window is itself a schedule the simulator can
    run (the measured timeline's simulated counterpart, traces and plots)."""
    lengths = [len(program) for program in schedule.programs]
    if max(lengths, default=0) <= WINDOW:
        return lengths
    units = max(units_per_update, 1)
    count = WINDOW * schedule.total_microbatches // max(lengths) // units * units
    for _ in range(8):
        if count <= 0:
            break
        try:
            found = cuts(schedule, [count])[0]
        except PipetrainError:  # this count cannot be cut (replicas updating together): one update less
            count -= units
            continue
        if max(found.positions) <= WINDOW:
            return found.positions
        count = count * 9 // 10 // units * units
    return [min(length, WINDOW) for length in lengths]


class ActionTimes:
    """Start and end times of one rank's actions (see the module docstring).

    ``starts[i]`` and ``ends[i]`` for the first ``window`` positions; with a longer program
    (``windowed``), ``busy`` sums the compute and update spans of every action and
    ``update_ends`` lists the end of every STEP of ``last_stage`` (the rank of its first replica
    passes it), for the report's rates and loss curves against time.
    """

    def __init__(self, program: Sequence[Action], last_stage: int | None = None, window: int | None = None) -> None:
        length = len(program)
        window = min(length, WINDOW) if window is None else window
        self.windowed = length > window
        self.window = window if self.windowed else length
        if self.windowed:  # 8 bytes a time, not a float object's 32
            self.starts: Sequence[float] = array("d", bytes(8 * self.window))
            self.ends: Sequence[float] = array("d", bytes(8 * self.window))
        else:
            self.starts = [0.0] * self.window
            self.ends = [0.0] * self.window
        self.busy = 0.0
        self.last_stage = last_stage
        self.update_ends = array("d")

    def record(self, action: Action, start: float, end: float) -> None:
        """Beyond the window (or for every action, of a windowed program): the aggregates."""
        kind = action[0]
        if kind in _BUSY:
            self.busy += end - start
            if kind is Kind.STEP and action[1] == self.last_stage:
                self.update_ends.append(end)

    def payload(self) -> dict:
        """What rank 0 needs to assemble the run's timeline."""
        out: dict = {"starts": self.starts, "ends": self.ends}
        if self.windowed:
            out["busy"] = self.busy
            out["update_ends"] = self.update_ends
        return out


def measured_timeline(schedule, payloads: Sequence[dict]):
    """The measured :class:`~pipetrain.schedule.timeline.Timeline` of a run from every rank's
    :meth:`ActionTimes.payload` (in rank order): the whole run, or for a long one the window of
    each rank's first actions, with the whole run's busy times and update ends."""
    starts = [p["starts"] for p in payloads]
    ends = [p["ends"] for p in payloads]
    if not any("busy" in p for p in payloads):
        return Timeline(schedule, starts, ends)
    window = replace(schedule, programs=[list(program[: len(s)]) for program, s in zip(schedule.programs, starts)])
    busy = [p["busy"] if "busy" in p else Timeline(window, starts, ends).busy(rank) for rank, p in enumerate(payloads)]
    last = schedule.stage_ranks[schedule.num_stages - 1][0]
    timeline = Timeline(window, starts, ends, busy_times=busy)
    if "update_ends" in payloads[last]:
        timeline.update_ends = payloads[last]["update_ends"]
    return timeline
