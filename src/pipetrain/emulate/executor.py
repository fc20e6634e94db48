"""Running the programs of all ranks in one process, in a valid global order.

Ranks take turns: each runs its program until it needs a message that has not been sent, or a
SYNC its replicas have not reached, and the ranks it was waiting for wake it when they get there.
Every stage replica's state is touched only by its own rank's actions, and messages carry exact
tensors, so the result does not depend on the interleaving: the distributed runtime, running the
same programs truly in parallel, computes the same numbers.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, MutableMapping, Sequence

import torch

from pipetrain.errors import DeadlockError, PipetrainError, StageError
from pipetrain.execution.data import UnitData
from pipetrain.execution.stage import StageExecutor, located
from pipetrain.execution.tied import TiedGradients, gradient_of
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.timing import ActionTimes, window_lengths
from pipetrain.execution.versions import version_release_points
from pipetrain.schedule.ir import Kind, Schedule, format_action

__all__ = ["Emulator", "all_reduce_sum"]


def all_reduce_sum(replicas: Sequence[StageExecutor]) -> None:
    """SYNC: every replica gets the sum (in replica order) of all replicas' accumulated gradients
    and sample counts (and under float16 whether any overflowed). The update then divides as the
    loss scaling prescribes."""
    names = set()
    for replica in replicas:
        names.update((replica.grads or {}).keys())
    total: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        parts = [r.grads[name] for r in replicas if r.grads and name in r.grads]
        acc = parts[0].clone()
        for part in parts[1:]:
            acc.add_(part)
        total[name] = acc
    samples = sum(r.pending_samples for r in replicas)
    overflow = any(r.overflowed for r in replicas)  # float16: every replica skips an overflowed update
    for replica in replicas:
        replica.grads = {n: t.clone() for n, t in total.items()} if replica is not replicas[0] else total
        replica.pending_samples = samples
        replica.share_overflow(overflow)


class Emulator:
    """Executes a schedule on stage executors (one per stage replica) in one process.

    Args:
        schedule: a validated schedule with versions assigned.
        executors: ``executors[rank][stage]``, the replica of ``stage`` held by ``rank``.
        data: the samples of each unit (microbatch); stage 0 reads inputs, the last stage targets.
        tied: where the stages sharing a parameter sum its gradient (:mod:`pipetrain.execution.tied`).
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
        self._tied_arrived: dict[tuple[int, int], set[int]] = {}  # (parameter, occurrence) -> ranks there
        self._tied_summed: set[tuple[int, int]] = set()
        self.executors = list(executors)
        self.data = data
        self.losses: MutableMapping[int, float] = UnitLosses()  # by unit, 9 bytes each
        self.paused = 0.0  # seconds spent in cut callbacks (evaluation), left out of timings
        #: measured start and end (seconds from the start of :meth:`run`) of every action, by rank
        last = schedule.num_stages - 1
        windows = window_lengths(schedule, data.layout.units_per_update)
        self.times = [ActionTimes(p, last if schedule.stage_ranks[last][0] == rank else None, windows[rank])
                      for rank, p in enumerate(schedule.programs)]
        self.starts: list[list[float]] = [t.starts for t in self.times]  # the window (all of a short program)
        self.ends: list[list[float]] = [t.ends for t in self.times]
        self._releases = [version_release_points(p) for p in schedule.programs]

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
        programs = self.schedule.programs
        self._on_unit = on_unit
        self._mailbox: dict[tuple, tuple] = {}
        self._labels: dict[int, Any] = {}  # unit -> targets, read with its inputs at stage 0 (as the runtime sends them on)
        self._outbox: dict[tuple, tuple] = {}
        self._constants: dict[tuple[int, int], int] = {}  # (stage, unit) -> inputs needing no gradient
        self._waiting: dict[tuple, int] = {}
        self._syncs: dict[tuple[int, int], list] = {}
        self._sync_seen = [dict() for _ in programs]
        self.positions = [0] * len(programs)
        self._origin = time.perf_counter()
        self._cuts = list(cuts)
        self._cut_index = 0  # the cut every rank is heading for next
        self._arrived: set[int] = set()

    def advance(self, limits: Sequence[int] | None = None) -> None:
        """Run every rank up to (not including) its position ``limits[rank]`` (default: the end of
        its program); ``limits`` must be a consistent cut, such as the end of a
        :func:`~pipetrain.schedule.cuts.feed_cuts` piece. Raises if a rank cannot get there."""
        schedule = self.schedule
        programs = schedule.programs
        last_stage = schedule.num_stages - 1
        layout = self.data.layout
        F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
        SEND_F, RECV_F, SEND_B, RECV_B, SYNC, STEP = (
            Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP,
        )
        mailbox, outbox, waiting, labels = self._mailbox, self._outbox, self._waiting, self._labels
        syncs, sync_seen = self._syncs, self._sync_seen
        pcs = self.positions
        ends_at = [len(p) for p in programs] if limits is None else list(limits)
        ready = deque(r for r in range(len(programs)) if pcs[r] < ends_at[r])
        queued = [r in ready for r in range(len(programs))]
        clock = time.perf_counter
        origin = self._origin
        pending_cuts = self._cuts
        arrived = self._arrived
        on_unit = self._on_unit

        def cut_position(rank: int) -> int | None:
            index = self._cut_index
            return pending_cuts[index][0][rank] if index < len(pending_cuts) else None

        def wake(other: int) -> None:
            if not queued[other]:
                queued[other] = True
                ready.append(other)

        def deliver(key: tuple, value: tuple) -> None:
            mailbox[key] = value
            waiter = waiting.pop(key, None)
            if waiter is not None and not queued[waiter]:
                queued[waiter] = True
                ready.append(waiter)

        while ready:
            rank = ready.popleft()
            queued[rank] = False
            program = programs[rank]
            stages = self.executors[rank]
            releases = self._releases[rank]
            pc = pcs[rank]
            limit = ends_at[rank]
            starts, ends = self.starts[rank], self.ends[rank]
            times = self.times[rank]
            window, windowed = times.window, times.windowed
            stop = cut_position(rank)  # changes only when a cut fires
            while True:
                if stop is not None and pc == stop:
                    arrived.add(rank)
                    if len(arrived) < len(programs):
                        break
                    paused = clock()
                    pending_cuts[self._cut_index][1]()
                    paused = clock() - paused
                    origin += paused  # timings leave evaluation pauses out
                    self.paused += paused
                    self._cut_index += 1
                    stop = cut_position(rank)
                    arrived.clear()
                    for other in range(len(programs)):
                        if other != rank and not queued[other] and pcs[other] < ends_at[other]:
                            queued[other] = True
                            ready.append(other)
                    continue
                if pc >= limit:
                    break
                action = program[pc]
                kind, stage, k, version, _ = action
                began = clock() - origin
                if pc < window:
                    starts[pc] = began
                try:
                    if kind is F:
                        executor = stages[stage]
                        if stage == 0:
                            inputs, target = self.data.unit(k)
                            if stage != last_stage:
                                labels[k] = target
                                target = None
                        else:
                            inputs = mailbox.pop(("F", stage, k))
                            target = labels.pop(k) if stage == last_stage else None
                        _, first, end = layout.bounds(k)
                        out = executor.forward(
                            k, version, inputs, target=target, loss_scale=layout.loss_scale(k), samples=end - first,
                            constants=self._constants.pop((stage, k), 0) if stage else 0,
                        )
                        if stage != last_stage and executor.last_constants:
                            self._constants[(stage + 1, k)] = executor.last_constants
                        if stage == last_stage:
                            loss = float(out[0])
                            self.losses[k] = loss
                            if on_unit is not None:
                                on_unit(k, loss)
                        elif schedule.rank_of(stage + 1, k) == rank:
                            deliver(("F", stage + 1, k), out)
                        else:
                            outbox[("F", stage, k)] = out
                    elif kind is B or kind is I:
                        executor = stages[stage]
                        grad_out = None if stage == last_stage else mailbox.pop(("B", stage, k))
                        if kind is B:
                            grads = executor.backward(k, version, grad_out)
                        else:
                            grads = executor.backward_input(k, version, grad_out)
                        if stage > 0:
                            if schedule.rank_of(stage - 1, k) == rank:
                                deliver(("B", stage - 1, k), grads)
                            else:
                                outbox[("B", stage, k)] = grads
                    elif kind is W:
                        stages[stage].backward_weight(k, version)
                    elif kind is SEND_F:
                        deliver(("F", stage + 1, k), outbox.pop(("F", stage, k)))
                    elif kind is SEND_B:
                        deliver(("B", stage - 1, k), outbox.pop(("B", stage, k)))
                    elif kind is RECV_F or kind is RECV_B:
                        key = ("F" if kind is RECV_F else "B", stage, k)
                        if key not in mailbox:
                            waiting[key] = rank
                            break
                    elif kind is SYNC:
                        index = sync_seen[rank].get(stage, 0)
                        state = syncs.setdefault((stage, index), [set(), False])
                        if not state[1]:
                            state[0].add(rank)
                            replicas = schedule.stage_ranks[stage]
                            if len(state[0]) < len(replicas):
                                break
                            all_reduce_sum([self.executors[r][stage] for r in replicas])
                            state[1] = True
                            for other in replicas:
                                if other != rank and not queued[other]:
                                    queued[other] = True
                                    ready.append(other)
                        sync_seen[rank][stage] = index + 1
                    elif kind is STEP:
                        if self.tied is not None and not self._tied_ready(rank, pc, wake):
                            break
                        superseded = [v for st, v in releases.get(pc, ()) if st == stage]
                        stages[stage].step(superseded)
                except StageError as error:  # a NaN loss, the user's exception: with the step
                    raise located(error, rank, action, lambda k: layout.bounds(k)[0]) from None
                except PipetrainError as error:
                    raise PipetrainError(f"rank {rank}, action {format_action(action)}: {error}") from None
                for release_stage, release_version in releases.get(pc, ()):
                    stages[release_stage].release(release_version)
                finished = clock() - origin
                if pc < window:
                    ends[pc] = finished
                if windowed:
                    times.record(action, began, finished)
                pc += 1
            pcs[rank] = pc
        self._origin = origin
        stuck = [r for r in range(len(programs)) if pcs[r] < ends_at[r]]
        if stuck:
            detail = ", ".join(f"rank {r} at {format_action(programs[r][pcs[r]])}" for r in stuck[:8])
            raise DeadlockError(f"the emulator cannot proceed: {detail}; run `pipetrain schedule --load` to find why")

    def end(self) -> MutableMapping[int, float]:
        """After :meth:`advance` reached the end of every program: the losses of every unit."""
        return self.losses

    def _tied_ready(self, rank: int, position: int, wake: Callable[[int], None]) -> bool:
        """Before ``rank``'s STEP at ``position``: a rendezvous of the ranks holding each shared
        parameter summed here; the last to arrive sums the gradients and wakes the others."""
        tied, executors = self.tied, self.executors
        ready = True
        for key in tied.due(rank, position):
            if key in self._tied_summed:
                continue
            t = key[0]
            arrived = self._tied_arrived.setdefault(key, set())
            arrived.add(rank)
            if len(arrived) < len(tied.ranks[t]):
                ready = False
                continue
            first = self.schedule.stage_ranks
            total = tied.total(t, lambda stage, name: gradient_of(executors[first[stage][0]][stage], name))
            tied.assign(t, total, [e for r in tied.ranks[t] for e in executors[r].values()])
            del self._tied_arrived[key]
            self._tied_summed.add(key)
            for other in tied.ranks[t]:
                if other != rank:
                    wake(other)
        return ready

