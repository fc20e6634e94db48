"""Running one rank's program over torch.distributed.

The same stage executors as the emulator (:class:`~pipetrain.execution.StageExecutor`) do the
arithmetic; this module moves tensors between ranks. Activations and gradients travel as
point-to-point messages; the labels of a microbatch ride along with its activations to the last
stage (one message per boundary, not two). All travel through a
:class:`~pipetrain.runtime.p2p.Messenger`, one channel per receiving stage and direction, so
messages of a channel arrive in the order the programs send them. SYNC all-reduces the accumulated
gradients of a stage's replicas (a process group per replicated stage).

When receives are posted (``receives=``): ``"on-demand"`` posts each receive when the program
reaches it and, once it arrived, waits for this rank's earlier sends, so transfers run while the
rank waits anyway. Gloo sends a message only once its receive is posted, and on a CPU its I/O
thread, which writes a message whose receive was posted late, competes with the computation for
the rank's core; the overhead-bound benchmark runs 20-25 % faster on demand (benchmarks/RESULTS.md,
section 3). Forced on demand, a schedule that the dry run refuses can deadlock (and then times
out). ``"ahead"`` keeps the next receive of every channel posted
and completes sends without blocking (:class:`~pipetrain.runtime.sends.SendLedger`). ``"auto"``
(the default) picks on-demand when a dry run proves it free of deadlock
(:func:`~pipetrain.runtime.sends.on_demand_is_safe`) for the run as it is, from the start or
from a resumed cut, with the cuts where all ranks pause together (checkpoints, evaluation; sends
that cross such a cut are waited for after it); ahead otherwise.

Every wait is bounded by the run's timeout: a dead or stuck peer ends the run with a message that
names the action this rank was waiting for and the last actions of every rank.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, MutableMapping

import torch
import torch.distributed as dist

from pipetrain.errors import NonFiniteError, PipetrainError, StageError
from pipetrain.execution.data import UnitData, UnitLayout
from pipetrain.execution.stage import StageExecutor, located
from pipetrain.execution.tied import TiedGradients, gradient_of
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.timing import ActionTimes, window_lengths
from pipetrain.execution.versions import version_release_points
from pipetrain.runtime.checkpoint import capture_rng, restore_rng
from pipetrain.runtime.errors import CommunicationError, DataWorkerLost
from pipetrain.runtime.p2p import Messenger, RecvHandle
from pipetrain.schedule.messages import Messages
from pipetrain.runtime.sends import SendLedger, on_demand_is_safe
from pipetrain.schedule.ir import Action, Kind, Schedule, format_action
from pipetrain.structure import append, flatten, split_last

__all__ = ["RankRunner", "sync_groups"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B, _SYNC, _STEP = (
    Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP,
)


def sync_groups(schedule: Schedule, tied: TiedGradients | None = None) -> dict[Any, Any]:
    """A process group for every replicated stage, and one under ``("tied", t)`` for the ranks
    holding shared parameter ``t`` (every rank must call this, in the same order)."""
    groups: dict[Any, Any] = {}
    for stage, ranks in enumerate(schedule.stage_ranks):
        if len(ranks) > 1:
            groups[stage] = dist.new_group(ranks=sorted(ranks))
    for t, ranks in enumerate(tied.ranks if tied else ()):
        if len(ranks) > 1:
            groups[("tied", t)] = dist.new_group(ranks=ranks)
    return groups


class _Waiting:
    """What a rank is waiting for, described lazily for error messages and the status board."""

    __slots__ = ("action", "peer")

    def __init__(self, action: Action, peer: int | None) -> None:
        self.action, self.peer = action, peer

    def __str__(self) -> str:
        text = format_action(self.action)
        return f"{text} (from rank {self.peer})" if self.peer is not None else text


class RankRunner:
    """Executes the program of ``rank`` with its stage executors.

    Args:
        schedule: the whole schedule (every rank builds the same one).
        rank: this process's rank.
        executors: ``{stage: StageExecutor}`` for the stages this rank holds.
        data: the unit data (read only on ranks that hold stage 0); ``layout`` gives every rank
            the unit sizes and loss scales.
        messenger: point-to-point transport; ``groups``: :func:`sync_groups`.
        status: an optional status board (recent actions, current wait).
        receives: ``"auto"``, ``"on-demand"`` or ``"ahead"`` (see the module docstring).
        messages: the schedule's :class:`~pipetrain.schedule.messages.Messages`, if already built.
        tied: where the stages sharing a parameter sum its gradient (:mod:`pipetrain.execution.tied`;
            its groups come from :func:`sync_groups`).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        executors: dict[int, StageExecutor],
        data: UnitData | None,
        layout: UnitLayout,
        messenger: Messenger,
        groups: dict[int, Any],
        status: Any = None,
        start: int = 0,
        receives: str = "auto",
        messages: Messages | None = None,
        tied: TiedGradients | None = None,
    ) -> None:
        self.schedule = schedule
        self.tied = tied if tied else None
        self.rank = rank
        self.executors = executors
        self.data = data
        self.layout = layout
        self.messenger = messenger
        self.groups = groups
        self.status = status
        self.program = schedule.programs[rank]
        self.last_stage = schedule.num_stages - 1
        self.losses: MutableMapping[int, float] = UnitLosses()  # of the units whose last stage runs here
        self.evaluations: list[dict[str, float]] = []
        self.paused = 0.0  # seconds spent in hooks (evaluation, checkpoints), left out of timings
        last_first = schedule.stage_ranks[self.last_stage][0] == rank
        window = window_lengths(schedule, layout.units_per_update)[rank]
        self.times = ActionTimes(self.program, self.last_stage if last_first else None, window)
        self.starts, self.ends = self.times.starts, self.times.ends  # the window (all of a short program)
        self._releases = version_release_points(self.program)
        self._local: dict[tuple, Any] = {}
        self._labels: dict[int, torch.Tensor] = {}  # labels of microbatches passing through this rank
        self._constants: dict[tuple[int, int], int] = {}  # (stage, unit) -> inputs needing no gradient (nonzero)
        self._messages = Messages(schedule) if messages is None else messages
        self._sends = SendLedger(schedule, rank, self._messages)
        self._posted: dict[tuple[int, str], RecvHandle] = {}
        self._queues: dict[tuple[int, str], deque] = {}
        self.start = start
        if receives not in ("auto", "on-demand", "ahead"):
            raise PipetrainError(f"receives must be 'auto', 'on-demand' or 'ahead', not {receives!r}")
        self.receives = receives
        self.on_demand = False
        self._pauses: list[list[int]] = []  # every rank's position of each cut where all pause
        self._resumed_cut: Any = None  # the cut a resumed run starts from (see restore)
        self._next_pause = 0
        self.position = start  # the next action to run (see advance)

    # -- receives posted ahead of need ----------------------------------------------------------

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
        from itertools import islice

        from pipetrain.schedule.pattern import PeriodicProgram

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

    def _choose_receives(self, hooks: dict, pauses: list[list[int]]) -> None:
        """On demand when asked, or under ``auto`` when the dry run proves it safe for this run:
        from the start or the resumed cut, with these pauses. A hook that is not one of the pauses
        (all ranks stopping together at a cut) could block this rank while a peer waits for it to
        take a send: it keeps the receives posted ahead."""
        if self.receives == "on-demand":
            self.on_demand = True
        elif self.receives == "auto":
            wanted = set(hooks)
            known = {pause[self.rank] for pause in pauses if pause[self.rank] in wanted}
            self.on_demand = all(position in known for position in hooks) and on_demand_is_safe(
                self.schedule, self._messages, pauses, start=self._resumed_cut
            )
        if not self.on_demand:
            self._plan_receives(self.start)

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
            # after the receive: the first message of a channel needs the receiver's wait
            self._sends.drain(self._upcoming())
            return payload, handle
        handle = self._posted.pop(channel)
        payload = handle.wait()
        self._post_next(channel)
        self._sends.received(position, channel[0])
        return payload, handle

    # -- sending -----------------------------------------------------------------------------------

    def _send(self, payload, peer: int, kind: str, microbatch: int, action: Action, position: int, info=()) -> None:
        handle = self.messenger.isend(payload, peer, kind, tag=microbatch, info=info, what=_Waiting(action, None))
        self._sends.sent(position, peer, handle)

    # -- the program ---------------------------------------------------------------------------

    def run(
        self,
        on_loss: Callable[[int, float], None] | None = None,
        origin: float | None = None,
        *,
        at_positions: dict[int, Callable[[], None]] | None = None,
        pauses: list[list[int]] | None = None,
    ) -> dict[int, float]:
        """Run the program from the runner's start position; returns the losses of the units whose last
        stage ran here. ``at_positions[p]()`` runs before the action at position ``p`` (or at the
        end, for ``p == len(program)``): checkpoints are taken there. ``pauses`` lists the cuts
        (every rank's position, in order) where the hooks of all ranks run together, which lets
        such runs receive on demand."""
        self.begin(on_loss, origin, at_positions=at_positions, pauses=pauses)
        self.advance()
        self.end()
        return self.losses

    def begin(
        self,
        on_loss: Callable[[int, float], None] | None = None,
        origin: float | None = None,
        *,
        at_positions: dict[int, Callable[[], None]] | None = None,
        pauses: list[list[int]] | None = None,
    ) -> None:
        """Set up a run that :meth:`advance` executes piece by piece (arguments as for :meth:`run`;
        a caller that returns to its own code between pieces names every piece's end in
        ``pauses``, so that no send is waited for across one)."""
        self._on_loss = on_loss
        self._origin = time.perf_counter() if origin is None else origin
        self._hooks = at_positions or {}
        self._pauses = pauses if hasattr(pauses, "pattern") else list(pauses or ())  # a long run's: a view
        self._next_pause = 0
        self._choose_receives(self._hooks, self._pauses)
        self._pause_at = self._pauses[0][self.rank] if self._pauses else -1  # this rank's next pause
        self.position = self.start

    def advance(self, stop: int | None = None) -> None:
        """Run the program from where it stands up to (not including) position ``stop`` (default:
        its end)."""
        schedule = self.schedule
        executors = self.executors
        last = self.last_stage
        rank = self.rank
        local = self._local
        releases = self._releases
        starts, ends = self.starts, self.ends
        times = self.times
        window, windowed = times.window, times.windowed
        done = self.status.done if self.status is not None else None
        clock = time.perf_counter
        origin = self._origin
        hooks = self._hooks
        on_loss = self._on_loss
        program = self.program
        stop = len(program) if stop is None else stop
        first_held = min(executors)  # the lowest stage on this rank
        pause_at = self._pause_at
        for pc in range(self.position, stop):
            if pc in hooks:  # evaluation or checkpoint: a pause that timings leave out
                paused = clock()
                hooks[pc]()
                paused = clock() - paused
                origin += paused
                self.paused += paused
            if pc == pause_at:
                pause_at = self._pass_pauses(pc)
            action = program[pc]
            kind, stage, k, version, _ = action
            began = clock() - origin
            if pc < window:
                starts[pc] = began
            try:
                if kind is _F:
                    self._forward(action, executors[stage], on_loss)
                elif kind is _B or kind is _I:
                    executor = executors[stage]
                    grad_out = None if stage == last else local.pop(("B", stage, k))
                    if kind is _B:
                        grads = executor.backward(k, version, grad_out)
                    else:
                        grads = executor.backward_input(k, version, grad_out)
                    if stage > 0:
                        local[("B", stage - 1, k)] = grads
                    if stage == first_held or schedule.rank_of(stage - 1, k) != rank:
                        self._labels.pop(k, None)
                elif kind is _W:
                    executors[stage].backward_weight(k, version)
                elif kind is _SEND_F:
                    payload = append(local.pop(("F", stage + 1, k)), self._labels[k])
                    constants = self._constants.pop((stage + 1, k), 0)
                    self._send(payload, schedule.peer_of(action), "act" + str(stage + 1), k, action, pc,
                               info=(constants,) if constants else ())
                elif kind is _SEND_B:
                    grads = local.pop(("B", stage - 1, k))
                    mask = sum(1 << i for i, g in enumerate(grads) if g is not None)
                    present = tuple(g for g in grads if g is not None)
                    self._send(present, schedule.peer_of(action), "grad" + str(stage - 1), k, action, pc,
                               info=(mask,))
                elif kind is _RECV_F:
                    payload, handle = self._receive((schedule.peer_of(action), "act" + str(stage)), pc)
                    local[("F", stage, k)], self._labels[k] = split_last(payload)
                    if handle.info:
                        self._constants[(stage, k)] = handle.info[0]
                elif kind is _RECV_B:
                    payload, handle = self._receive((schedule.peer_of(action), "grad" + str(stage)), pc)
                    local[("B", stage, k)] = _unmask(payload, handle.info[0] if handle.info else None)
                elif kind is _SYNC:
                    self._all_reduce(stage)
                elif kind is _STEP:
                    if self.tied is not None:
                        self._sum_tied(pc)
                    executors[stage].step([v for s, v in releases.get(pc, ()) if s == stage])
            except (CommunicationError, DataWorkerLost):  # a fault, its exit status kept
                raise
            except StageError as error:  # a NaN loss, the user's exception: with the step
                raise located(error, rank, action, lambda k: self.layout.bounds(k)[0]) from None
            except PipetrainError as error:
                raise PipetrainError(f"rank {rank}, action {format_action(action)}: {error}") from None
            except RuntimeError as error:
                raise _runtime_error(rank, action, error) from None
            for release_stage, release_version in releases.get(pc, ()):
                executors[release_stage].release(release_version)
            if done is not None:
                done(action)
            finished = clock() - origin
            if pc < window:
                ends[pc] = finished
            if windowed:
                times.record(action, began, finished)
        self.position = max(self.position, stop)
        self._origin, self._pause_at = origin, pause_at

    def end(self) -> None:
        """After the last action: the hook at the program's end, then every send completed."""
        if len(self.program) in self._hooks:
            paused = time.perf_counter()
            self._hooks[len(self.program)]()
            self.paused += time.perf_counter() - paused
        self._sends.drain()

    def _upcoming(self) -> list[int] | None:
        """Every rank's position of the next pause this rank has not passed (None: no more)."""
        return self._pauses[self._next_pause] if self._next_pause < len(self._pauses) else None

    def _pass_pauses(self, position: int) -> int:
        """This rank has run its hooks at ``position``: the pauses there are behind it. Returns its
        position of the next pause (-1 when none is left)."""
        upcoming = self._upcoming()
        while upcoming is not None and upcoming[self.rank] == position:
            self._next_pause += 1
            upcoming = self._upcoming()
        return -1 if upcoming is None else upcoming[self.rank]

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, count: int, batch_at: Callable[[int], tuple], metrics: Any) -> dict[str, float] | None:
        """Forward-only passes of ``count`` held-out batches through the first replica of every
        stage, on the current weights; on the rank of the last stage, each output and its labels
        go to ``metrics.add(output, target)`` and ``metrics.result()`` is returned.

        Every rank calls it at the same cut (between updates); ``batch_at(i)`` is called only where
        stage 0 lives, and its labels travel to the last stage. Its own channels keep training
        messages in flight undisturbed.
        """
        rank, last = self.rank, self.last_stage
        owners = [ranks[0] for ranks in self.schedule.stage_ranks]
        mine = [s for s in sorted(self.executors) if owners[s] == rank]
        if not mine:
            return None
        sends = []
        for index in range(count):
            value = labels = None
            if owners[0] == rank:
                value, labels = batch_at(index)
                if owners[last] != rank:
                    sends.append(self.messenger.isend(labels, owners[last], "eval-labels", tag=index))
            for stage in mine:
                if stage > 0 and owners[stage - 1] != rank:
                    value = self.messenger.recv(owners[stage - 1], f"eval{stage}", expect_tag=index)
                value = self.executors[stage].evaluate(value)
                if stage < last and owners[stage + 1] != rank:
                    sends.append(self.messenger.isend(value, owners[stage + 1], f"eval{stage + 1}", tag=index))
            if last in mine:
                if owners[0] != rank:
                    labels = self.messenger.recv(owners[0], "eval-labels", expect_tag=index)
                metrics.add(value, labels)
        for handle in sends:
            handle.wait()
        return metrics.result() if last in mine else None

    # -- checkpoints ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This rank's state at its cut (see :mod:`pipetrain.schedule.cuts`). Sends still under way
        are not waited for: a message that crosses the cut is received only after the receiver's
        own cut, and a resumed run sends it again."""
        try:
            stages = {stage: executor.snapshot() for stage, executor in self.executors.items()}
        except NonFiniteError as error:  # no checkpoint of weights that are not finite
            raise NonFiniteError(f"rank {self.rank}, {error}", stage=error.stage, step=error.step,
                                 rank=self.rank) from None
        return {
            "stages": stages,
            "losses": dict(self.losses),
            "labels": dict(self._labels),
            "evaluations": list(self.evaluations),
            "rng": capture_rng(),
        }

    def keep_for_cuts(self, positions: list[int]) -> None:
        """Keep every version that a forward in flight at one of these cuts (this rank's positions
        of the cuts where it checkpoints) read, up to the cut, so that the checkpoint holds it
        (see :func:`~pipetrain.schedule.cuts.in_flight`); released right after the cut."""
        from pipetrain.schedule.cuts import in_flight

        if not positions:
            return
        released = self._released()
        for cut, forwards in zip(positions, in_flight(self.program, positions)):
            for key in {(action.stage, action.version) for action in forwards}:
                early = released(key, cut)
                if early is not None and early < cut:
                    self._releases[early] = [k for k in self._releases[early] if k != key]
                    self._releases.setdefault(cut, []).append(key)
                    table = getattr(released, "table", None)
                    if table is not None:
                        table[key] = cut

    def _released(self):
        """``released(key, position)``: where (stage, version) ``key`` is released, for the keys of
        forwards in flight at ``position`` (None if never). A long program's table is searched
        near the position (:meth:`~pipetrain.schedule.pattern.ShiftedReleases.released_before`)."""
        releases = self._releases
        if hasattr(releases, "released_before"):
            return releases.released_before
        table = {key: position for position, keys in releases.items() for key in keys}

        def released(key, position: int, table: dict = table) -> int | None:
            return table.get(key)

        released.table = table  # type: ignore[attr-defined]
        return released

    def restore(self, state: dict[str, Any], cut) -> int:
        """Load this rank's state at ``cut``, replay the forwards in flight and re-send what
        crossed the cut; returns the program position to continue from."""
        from pipetrain.schedule.cuts import in_flight

        schedule, rank, program = self.schedule, self.rank, self.program
        position = cut.positions[rank]
        forwards = in_flight(program, [position])[0]
        _check_in_flight(state, forwards, rank, cut.units // self.layout.units_per_update)
        self._resumed_cut = cut
        self.losses = UnitLosses(state["losses"])
        self._labels = dict(state["labels"])
        self.evaluations = list(state.get("evaluations", []))
        restore_rng(state["rng"])
        crossing = {(program[p].stage, program[p].microbatch): (p, program[p]) for p in cut.crossing_sends[rank]}
        later_forwards = {(a.stage, a.microbatch) for a in _after(program, position) if a.kind is _F}
        for stage in sorted(self.executors):
            replayed = self.executors[stage].restore(state["stages"][stage])
            for k, out, constants in replayed:
                if stage == self.last_stage:
                    continue
                if schedule.rank_of(stage + 1, k) == rank:
                    if (stage + 1, k) in later_forwards:
                        self._local[("F", stage + 1, k)] = out
                        if constants:
                            self._constants[(stage + 1, k)] = constants
                elif (stage, k) in crossing:
                    sent_at, action = crossing[(stage, k)]
                    self._send(append(out, self._labels[k]), schedule.peer_of(action), "act" + str(stage + 1), k,
                               action, sent_at, info=(constants,) if constants else ())
        # versions kept only for the checkpoint (keep_for_cuts): the program released them before the cut
        released = self._released()
        for stage, version in {(action.stage, action.version) for action in forwards}:
            at = released((stage, version), position)
            if (position if at is None else at) < position:
                self.executors[stage].release(version)
        return position

    def _forward(self, action: Action, executor: StageExecutor, on_loss) -> None:
        kind, stage, k, version, _ = action
        layout, local = self.layout, self._local
        target = None
        if stage == 0:
            inputs, self._labels[k] = self.data.unit(k)
        else:
            inputs = local.pop(("F", stage, k))
        if stage == self.last_stage:
            target = self._labels[k]
        _, start, stop = layout.bounds(k)
        out = executor.forward(k, version, inputs, target=target, loss_scale=layout.loss_scale(k), samples=stop - start,
                               constants=self._constants.pop((stage, k), 0) if stage else 0)
        if stage != self.last_stage and executor.last_constants:
            self._constants[(stage + 1, k)] = executor.last_constants
        if stage == self.last_stage:
            loss = float(out[0])
            self.losses[k] = loss
            if on_loss is not None:
                on_loss(k, loss)
        else:
            for value in flatten(out)[0]:
                if not isinstance(value, torch.Tensor):
                    raise PipetrainError(
                        f"stage {stage} returned a {type(value).__name__}; stages must pass tensors (alone, or in "
                        "tuples, lists and dicts) to the next stage"
                    )
            local[("F", stage + 1, k)] = out

    def _all_reduce(self, stage: int) -> None:
        """SYNC: sum the accumulated gradients and sample counts of the stage's replicas (and under
        float16 tell each whether any overflowed)."""
        executor = self.executors[stage]
        group = self.groups.get(stage)
        if group is None:
            return
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

    def _sum_tied(self, position: int) -> None:
        """Before a STEP: sum the gradients of the shared parameters due here. Each holder's part
        is broadcast from its first replica's rank, and every rank adds the parts in stage order."""
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


def _check_in_flight(state: dict[str, Any], forwards: list[Action], rank: int, step: int) -> None:
    """Refuse a checkpoint whose forwards in flight are not those this run's program has at the
    cut: it was written by a run of another length, whose programs end differently (an
    asynchronous schedule drains its pipeline at the end)."""
    from pipetrain.runtime.errors import CheckpointMismatchError

    for stage, saved in state["stages"].items():
        held = sorted(record["microbatch"] for record in saved["in_flight"])
        expected = sorted(action.microbatch for action in forwards if action.stage == stage)
        if held != expected:
            raise CheckpointMismatchError(
                f"rank {rank}: the checkpoint of step {step} holds microbatches {held} of stage {stage} in "
                f"flight, where this run's program has {expected}: it was written by a run of another length "
                "(--steps / --epochs), whose pipeline drains at a different point; resume with the length it was "
                "written with, or continue that run for more updates with --extend (fit(extend=True)), which drains "
                "the pipeline where that run ended"
            )


def _after(program, position: int):
    """The actions of ``program`` from ``position`` on; of a long one, those within a period's
    reach (where the forwards of the microbatches in flight at ``position`` lie)."""
    from pipetrain.schedule.pattern import PeriodicProgram

    if isinstance(program, PeriodicProgram) and program.pattern is not None:
        return program[position: position + program.pattern.lag(program.rank)]
    return program[position:]


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


def _runtime_error(rank: int, action: Action, error: RuntimeError) -> PipetrainError:
    from pipetrain.data.prefetch import lost_data_worker

    lost = lost_data_worker(error, rank)  # a fault, not bad input: the run may be restarted
    if lost is not None:
        return lost
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if "shape" in text or "size" in text or "mat1 and mat2" in text:
        return PipetrainError(
            f"rank {rank}, action {format_action(action)}: stage {action.stage} cannot take what it was given "
            f"({text}); check that the output of stage {action.stage - 1} matches the input of stage {action.stage}"
        )
    return PipetrainError(f"rank {rank}, action {format_action(action)} failed: {text}")
