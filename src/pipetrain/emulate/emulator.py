"""Running the programs of all ranks in one process, in a valid global order.

Every rank's program runs on the one interpreter of the IR
(:class:`~pipetrain.execution.interpreter.Interpreter`, the runtime's too) over the in-process
transport (:mod:`pipetrain.emulate.in_process`). Ranks take turns: each runs its program until it
needs a message that has not been sent, or a SYNC its replicas have not reached, and the ranks it
was waiting for wake it when they get there. Every stage replica's state is touched only by its
own rank's actions, and messages carry exact tensors, so the result does not depend on the
interleaving: the distributed runtime, running the same programs truly in parallel, computes the
same numbers.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, MutableMapping, Sequence

from pipetrain.emulate.in_process import Mailboxes, all_reduce_sum
from pipetrain.errors import DeadlockError
from pipetrain.execution.data import UnitData
from pipetrain.execution.interpreter import Interpreter
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.tied_gradients import TiedGradients
from pipetrain.execution.timing import window_lengths
from pipetrain.schedule.ir import Schedule, format_action

__all__ = ["Emulator", "all_reduce_sum"]


class Emulator:
    """Executes a schedule on stage executors (one per stage replica) in one process.

    Args:
        schedule: a validated schedule with versions assigned.
        executors: ``executors[rank][stage]``, the replica of ``stage`` held by ``rank``.
        data: the samples of each unit (microbatch); stage 0 reads inputs, the last stage targets.
        tied: where the stages sharing a parameter sum its gradient (:mod:`pipetrain.execution.tied_gradients`).
    """

    def __init__(
        self,
        schedule: Schedule,
        executors: Sequence[dict[int, StageExecutor]],
        data: UnitData,
        tied: TiedGradients | None = None,
    ) -> None:
        self.schedule = schedule
        self.tied = tied if tied else None
        self.executors = list(executors)
        self.data = data
        self.losses: MutableMapping[int, float] = UnitLosses()  # by unit, 9 bytes each
        self.paused = 0.0  # seconds spent in cut callbacks (evaluation), left out of timings
        self._on_unit: Callable[[int, float], None] | None = None
        self._ready: deque[int] = deque()
        self._queued = [False] * len(schedule.programs)
        self.mailboxes = Mailboxes(schedule, self.executors, self._wake, self.tied)
        windows = window_lengths(schedule, data.layout.units_per_update)
        self.interpreters = [
            Interpreter(schedule, rank, stages, data, data.layout, self.mailboxes.transport(rank),
                        on_loss=self._unit_done, window=windows[rank])
            for rank, stages in enumerate(self.executors)
        ]
        for interpreter in self.interpreters:
            interpreter.losses = self.losses  # one table for the replicas of the last stage
        #: measured start and end (seconds from the start of :meth:`run`) of every action, by rank
        self.times = [interpreter.times for interpreter in self.interpreters]
        self.starts: list[list[float]] = [t.starts for t in self.times]  # the window (all of a short program)
        self.ends: list[list[float]] = [t.ends for t in self.times]
        self.positions = [0] * len(schedule.programs)

    def run(
        self,
        on_unit: Callable[[int, float], None] | None = None,
        *,
        cuts: Sequence[tuple[Sequence[int], Callable[[], None]]] = (),
    ) -> MutableMapping[int, float]:
        """Run every action; returns the mean loss of each unit (microbatch), by unit number.

        ``on_unit(k, loss)`` is called when the last stage finishes the forward of unit k. Each
        ``(positions, callback)`` of ``cuts`` stops every rank r before its action
        ``positions[r]`` (a consistent cut, see :mod:`pipetrain.schedule.cuts`) and calls
        ``callback()`` once all have arrived: evaluation sees every stage as the runtime does.
        """
        self.begin(on_unit, cuts=cuts)
        self.advance()
        return self.end()

    def begin(
        self,
        on_unit: Callable[[int, float], None] | None = None,
        *,
        cuts: Sequence[tuple[Sequence[int], Callable[[], None]]] = (),
    ) -> None:
        """Set up a run that :meth:`advance` executes piece by piece (arguments as for :meth:`run`)."""
        self._on_unit = on_unit
        self.positions = [0] * len(self.schedule.programs)
        self.mailboxes.restart()
        origin = time.perf_counter()
        for interpreter in self.interpreters:
            interpreter.origin = origin
            interpreter.local.clear()
            interpreter.labels.clear()
            interpreter.constants.clear()
        self._cuts = list(cuts)
        self._cut_index = 0  # the cut every rank is heading for next
        self._arrived: set[int] = set()

    def _unit_done(self, k: int, loss: float) -> None:
        if self._on_unit is not None:
            self._on_unit(k, loss)

    def _wake(self, rank: int) -> None:
        if not self._queued[rank]:
            self._queued[rank] = True
            self._ready.append(rank)

    def advance(self, limits: Sequence[int] | None = None) -> None:
        """Run every rank up to (not including) its position ``limits[rank]`` (default: the end of
        its program); ``limits`` must be a consistent cut, such as the end of a
        :func:`~pipetrain.schedule.cuts.feed_cuts` piece. Raises if a rank cannot get there."""
        programs = self.schedule.programs
        pcs = self.positions
        ends_at = [len(p) for p in programs] if limits is None else list(limits)
        ready, queued = self._ready, self._queued
        ready.clear()
        ready.extend(r for r in range(len(programs)) if pcs[r] < ends_at[r])
        for r in range(len(programs)):
            queued[r] = r in ready
        pending_cuts, arrived = self._cuts, self._arrived
        clock = time.perf_counter

        def cut_position(rank: int) -> int | None:
            index = self._cut_index
            return pending_cuts[index][0][rank] if index < len(pending_cuts) else None

        while ready:
            rank = ready.popleft()
            queued[rank] = False
            interpreter = self.interpreters[rank]
            pc = pcs[rank]
            limit = ends_at[rank]
            stop = cut_position(rank)  # changes only when a cut fires
            while True:
                if stop is not None and pc == stop:
                    arrived.add(rank)
                    if len(arrived) < len(programs):
                        break
                    paused = clock()
                    pending_cuts[self._cut_index][1]()
                    paused = clock() - paused
                    for other in self.interpreters:  # timings leave evaluation pauses out
                        other.origin += paused
                    self.paused += paused
                    self._cut_index += 1
                    stop = cut_position(rank)
                    arrived.clear()
                    for other in range(len(programs)):
                        if other != rank and pcs[other] < ends_at[other]:
                            self._wake(other)
                    continue
                if pc >= limit:
                    break
                until = stop if stop is not None and pc < stop < limit else limit
                reached = interpreter.run(pc, until)
                blocked = reached < until
                pc = reached
                if blocked:
                    break
            pcs[rank] = pc
        stuck = [r for r in range(len(programs)) if pcs[r] < ends_at[r]]
        if stuck:
            detail = ", ".join(f"rank {r} at {format_action(programs[r][pcs[r]])}" for r in stuck[:8])
            raise DeadlockError(f"the emulator cannot proceed: {detail}; run `pipetrain schedule --load` to find why")

    def end(self) -> MutableMapping[int, float]:
        """After :meth:`advance` reached the end of every program: the losses of every unit."""
        return self.losses
