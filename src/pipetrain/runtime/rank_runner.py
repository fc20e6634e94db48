"""Running one rank's program over torch.distributed.

The program runs on the emulator's interpreter (:class:`~pipetrain.execution.interpreter.Interpreter`:
the same dispatch to the same stage executors) over :class:`~pipetrain.runtime.distributed_transport.DistributedTransport`,
which moves tensors between ranks. Activations and gradients travel as point-to-point messages;
the labels of a microbatch ride along with its activations to the last stage (one message per
boundary, not two). All travel through a :class:`~pipetrain.runtime.p2p.Messenger`, one channel
per receiving stage and direction, so messages of a channel arrive in the order the programs send
them. SYNC all-reduces the accumulated gradients of a stage's replicas (a process group per
replicated stage). This module adds what only a process of its own has: hooks (checkpoints,
evaluation) at positions, the pauses where all ranks stop together, checkpoints and resuming.

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
that cross such a cut are waited for after it), and the schedule does not split its backwards
into I and W (the zero-bubble family ran 1.27-1.42x slower on demand); ahead otherwise.

Every wait is bounded by the run's timeout: a dead or stuck peer ends the run with a message that
names the action this rank was waiting for and the last actions of every rank. An evaluation's
waits (with a :class:`~pipetrain.runtime.liveness.Liveness`) are bounded by the peer's silence
instead: it is long work.
"""

from __future__ import annotations

import json
import time
from bisect import bisect_right
from typing import Any, Callable, MutableMapping

import torch.distributed as dist

from pipetrain.data.worker_deaths import lost_data_worker
from pipetrain.errors import NonFiniteError, PipetrainError, option
from pipetrain.execution.data import UnitData, UnitLayout
from pipetrain.execution.interpreter import Interpreter
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.tied_gradients import TiedGradients
from pipetrain.runtime.checkpoint import capture_rng, restore_rng
from pipetrain.runtime.errors import CheckpointMismatchError, CommunicationError, DataWorkerLost
from pipetrain.runtime.liveness import Liveness
from pipetrain.runtime.p2p import Messenger
from pipetrain.runtime.distributed_transport import DistributedTransport
from pipetrain.schedule.cuts import in_flight
from pipetrain.schedule.ir import Action, Kind, Schedule, format_action, halves
from pipetrain.schedule.messages import Messages
from pipetrain.schedule.pattern import PeriodicProgram

__all__ = ["RankRunner", "sync_groups"]

_F = Kind.F


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
        tied: where the stages sharing a parameter sum its gradient (:mod:`pipetrain.execution.tied_gradients`;
            its groups come from :func:`sync_groups`).
        liveness: an optional :class:`~pipetrain.runtime.liveness.Liveness`: evaluations then wait
            on their peers for as long as those are heard from, and give every rank the metrics.
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
        liveness: Liveness | None = None,
    ) -> None:
        self.schedule = schedule
        self.liveness = liveness
        self._evaluated = 0  # evaluations so far: every rank of the run counts the same ones
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
        self.evaluations: list[dict[str, float]] = []
        self.paused = 0.0  # seconds spent in hooks (evaluation, checkpoints), left out of timings
        self._messages = Messages(schedule) if messages is None else messages
        self.transport = DistributedTransport(schedule, rank, executors, messenger, groups, self._messages, tied)
        self.interpreter = Interpreter(schedule, rank, executors, data, layout, self.transport, tensors_only=True,
                                       faults=(CommunicationError, DataWorkerLost), explain=_runtime_error)
        self.times = self.interpreter.times
        self.starts, self.ends = self.times.starts, self.times.ends  # the window (all of a short program)
        self._releases = self.interpreter.releases
        self.start = start
        if receives not in ("auto", "on-demand", "ahead"):
            raise PipetrainError(f"receives must be 'auto', 'on-demand' or 'ahead', not {receives!r}")
        self.receives = receives
        self._pauses: list[list[int]] = []  # every rank's position of each cut where all pause
        self._resumed_cut: Any = None  # the cut a resumed run starts from (see restore)
        self.position = start  # the next action to run (see advance)

    @property
    def losses(self) -> MutableMapping[int, float]:
        """The losses of the units whose last stage runs here."""
        return self.interpreter.losses

    @losses.setter
    def losses(self, value: MutableMapping[int, float]) -> None:
        self.interpreter.losses = value

    @property
    def on_demand(self) -> bool:
        """Whether receives are posted when the program reaches them (see the module docstring)."""
        return self.transport.on_demand

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
        interpreter = self.interpreter
        interpreter.on_loss = on_loss
        interpreter.origin = time.perf_counter() if origin is None else origin
        interpreter.done = self.status.done if self.status is not None else None
        self._hooks = at_positions or {}
        self._hook_positions = sorted(self._hooks)
        self._pauses = pauses if hasattr(pauses, "pattern") else list(pauses or ())  # a long run's: a view
        # this rank's next pause
        self._pause_at = self.transport.begin(self.receives, self._hooks, self._pauses, self.start, self._resumed_cut)
        self.position = self.start

    def advance(self, stop: int | None = None) -> None:
        """Run the program from where it stands up to (not including) position ``stop`` (default:
        its end). Hooks run before their position, and the pauses a rank passes are counted
        before the action there runs (sends are waited for up to the next one)."""
        interpreter, transport, hooks, marks = self.interpreter, self.transport, self._hooks, self._hook_positions
        clock = time.perf_counter
        stop = len(self.program) if stop is None else stop
        pause_at = self._pause_at
        pc = self.position
        while pc < stop:
            if pc in hooks:  # evaluation or checkpoint: a pause that timings leave out
                paused = clock()
                hooks[pc]()
                paused = clock() - paused
                interpreter.origin += paused
                self.paused += paused
            if pc == pause_at:
                pause_at = transport.pass_pauses(pc)
            until = stop
            following = bisect_right(marks, pc)  # the next hook
            if following < len(marks) and marks[following] < until:
                until = marks[following]
            if pc < pause_at < until:
                until = pause_at
            reached = interpreter.run(pc, until)
            if reached != until:  # never: this transport blocks until its message arrives
                raise PipetrainError(f"rank {self.rank} stopped at position {reached} of its program before {until}")
            pc = reached
        self.position = max(self.position, stop)
        self._pause_at = pause_at

    def end(self) -> None:
        """After the last action: the hook at the program's end, then every send completed."""
        if len(self.program) in self._hooks:
            paused = time.perf_counter()
            self._hooks[len(self.program)]()
            self.paused += time.perf_counter() - paused
        self.transport.drain()

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, count: int, batch_at: Callable[[int], tuple], metrics: Any) -> dict[str, float] | None:
        """Forward-only passes of ``count`` held-out batches through the first replica of every
        stage, on the current weights; on the rank of the last stage, each output and its labels
        go to ``metrics.add(output, target)``, and ``metrics.result()`` is returned there (with a
        :attr:`liveness`: on every rank, each returning once the last stage has the result).

        Every rank calls it at the same cut (between updates); ``batch_at(i)`` is called only where
        stage 0 lives, and its labels travel to the last stage. Its own channels keep training
        messages in flight undisturbed. With a :attr:`liveness`, each message is announced in the
        store when sent, and its receiver waits for the announcement as long as the sender is heard
        from (an evaluation is long work, see :mod:`pipetrain.runtime.liveness`) before it waits for
        the message itself.
        """
        rank, last, live = self.rank, self.last_stage, self.liveness
        owners = [ranks[0] for ranks in self.schedule.stage_ranks]
        mine = [s for s in sorted(self.executors) if owners[s] == rank]
        name = f"eval{self._evaluated}"
        self._evaluated += 1
        sends = []
        for index in range(count if mine else 0):
            value = labels = None
            if owners[0] == rank:
                value, labels = batch_at(index)
                if owners[last] != rank:
                    sends.append(self.messenger.isend(labels, owners[last], "eval-labels", tag=index))
                    if live is not None:
                        live.post(f"{name}/labels")
            for stage in mine:
                if stage > 0 and owners[stage - 1] != rank:
                    if live is not None:
                        live.await_count(f"{name}/{stage}", index + 1, owners[stage - 1],
                                         f"held-out batch {index} of stage {stage} from rank {owners[stage - 1]}")
                    value = self.messenger.recv(owners[stage - 1], f"eval{stage}", expect_tag=index)
                value = self.executors[stage].evaluate(value)
                if stage < last and owners[stage + 1] != rank:
                    sends.append(self.messenger.isend(value, owners[stage + 1], f"eval{stage + 1}", tag=index))
                    if live is not None:
                        live.post(f"{name}/{stage + 1}")
            if last in mine:
                if owners[0] != rank:
                    if live is not None:
                        live.await_count(f"{name}/labels", index + 1, owners[0],
                                         f"the labels of held-out batch {index} from rank {owners[0]}")
                    labels = self.messenger.recv(owners[0], "eval-labels", expect_tag=index)
                metrics.add(value, labels)
        result = metrics.result() if last in mine else None
        if live is not None:  # the end of the evaluation for every rank: the last stage has the result
            if last in mine:
                live.put(f"{name}/metrics", json.dumps(result))
            else:
                result = json.loads(live.await_value(f"{name}/metrics", owners[last],
                                                     f"the result of the evaluation from rank {owners[last]}"))
        for handle in sends:  # every message was received by now, with a liveness
            handle.wait()
        return result

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
            "labels": dict(self.interpreter.labels),
            "evaluations": list(self.evaluations),
            "rng": capture_rng(),
        }

    def keep_for_cuts(self, positions: list[int]) -> None:
        """Keep every version that a forward in flight at one of these cuts (this rank's positions
        of the cuts where it checkpoints) read, up to the cut, so that the checkpoint holds it
        (see :func:`~pipetrain.schedule.cuts.in_flight`); released right after the cut."""
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
        schedule, rank, program = self.schedule, self.rank, self.program
        position = cut.positions[rank]
        forwards = in_flight(program, [position])[0]
        _check_in_flight(state, forwards, rank, cut.units // self.layout.units_per_update)
        self._resumed_cut = cut
        self.losses = UnitLosses(state["losses"])
        labels = self.interpreter.labels
        labels.clear()
        labels.update(state["labels"])
        self.evaluations = list(state.get("evaluations", []))
        restore_rng(state["rng"])
        crossing = {(program[p].stage, program[p].microbatch): (p, program[p]) for p in cut.crossing_sends[rank]}
        later_forwards = {(h.stage, h.microbatch) for a in _after(program, position) for h in halves(a) if h.kind is _F}
        for stage in sorted(self.executors):
            replayed = self.executors[stage].restore(state["stages"][stage])
            for k, out, constants in replayed:
                if stage == self.last_stage:
                    continue
                if schedule.rank_of(stage + 1, k) == rank:
                    if (stage + 1, k) in later_forwards:
                        self.interpreter.local[("F", stage + 1, k)] = out
                        if constants:
                            self.interpreter.constants[(stage + 1, k)] = constants
                elif (stage, k) in crossing:
                    sent_at, action = crossing[(stage, k)]
                    self.transport.send_activations(action, sent_at, out, labels[k], constants)
        # versions kept only for the checkpoint (keep_for_cuts): the program released them before the cut
        released = self._released()
        for stage, version in {(action.stage, action.version) for action in forwards}:
            at = released((stage, version), position)
            if (position if at is None else at) < position:
                self.executors[stage].release(version)
        return position

def _check_in_flight(state: dict[str, Any], forwards: list[Action], rank: int, step: int) -> None:
    """Refuse a checkpoint whose forwards in flight are not those this run's program has at the
    cut: it was written by a run of another length, whose programs end differently (an
    asynchronous schedule drains its pipeline at the end)."""
    for stage, saved in state["stages"].items():
        held = sorted(record["microbatch"] for record in saved["in_flight"])
        expected = sorted(action.microbatch for action in forwards if action.stage == stage)
        if held != expected:
            raise CheckpointMismatchError(
                f"rank {rank}: the checkpoint of step {step} holds microbatches {held} of stage {stage} in "
                f"flight, where this run's program has {expected}: it was written by a run of another length "
                f"({option('steps')} / {option('epochs')}), whose pipeline drains at a different point; resume with "
                f"the length it was written with, or continue that run for more updates by turning on "
                f"{option('extend')}, which drains the pipeline where that run ended"
            )


def _after(program, position: int):
    """The actions of ``program`` from ``position`` on; of a long one, those within a period's
    reach (where the forwards of the microbatches in flight at ``position`` lie)."""
    if isinstance(program, PeriodicProgram) and program.pattern is not None:
        return program[position: position + program.pattern.lag(program.rank)]
    return program[position:]


def _runtime_error(rank: int, action: Action, error: RuntimeError) -> PipetrainError:
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
