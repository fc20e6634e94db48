"""The one interpreter of the schedule IR: a rank's program of actions, dispatched to its stage
executors and to a :class:`Transport`.

The emulator (every rank in one process) and the distributed runtime (one process per rank) both
run this dispatch, so that they can differ only where their transports do: the emulator's
moves exact tensors between mailboxes in memory, the runtime's over torch.distributed. What
differs for a reason is named here as an argument: ``tensors_only`` (torch.distributed carries
only tensors), ``faults`` (failures whose exit status the runtime keeps), ``explain`` (the
runtime words torch's errors with the action) and ``done`` (the runtime's status board).

A pair (``(0F7;3B2)``, DualPipe's paired forward and backward) runs its forward, then its
backward: a GPU would overlap the two (one half's communication under the other's compute); on a
CPU the halves run one after the other, with the same numbers.

A transport may answer a receive, a SYNC or a tied-gradient sum with :data:`WAIT` (the message or
the peers are not there yet): :meth:`Interpreter.run` then returns the position of that action,
which runs again from its start when the caller resumes the rank. A blocking transport (the
runtime's) never answers :data:`WAIT`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, MutableMapping, Protocol, Sequence

import torch

from pipetrain.errors import PipetrainError, StageError
from pipetrain.execution.data import UnitData, UnitLayout
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.failures import StageNames, located
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.timing import ActionTimes, window_lengths
from pipetrain.execution.version_store import version_release_points
from pipetrain.schedule.ir import Action, Kind, Schedule, format_action, halves
from pipetrain.structure import flatten

__all__ = ["WAIT", "Interpreter", "Transport"]


class _Wait:
    """The answer of a transport whose message or peers have not arrived yet."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WAIT"


WAIT: Any = _Wait()

_F, _B, _I, _W, _FB = Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB
_SEND_F, _RECV_F, _SEND_B, _RECV_B, _SYNC, _STEP = (
    Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP,
)


class Transport(Protocol):
    """What moves a rank's messages and runs its collectives. ``action`` is the program's SEND or
    RECV (its stage, microbatch and peer), ``position`` its place in the rank's program."""

    def send_activations(self, action: Action, position: int, payload: Any, labels: Any, constants: int) -> None:
        """SEND_F: the output of ``action.stage`` for its microbatch, the microbatch's labels (they
        travel with the activations to the last stage) and how many of the leading inputs of the
        next stage need no gradient (0: all do)."""

    def receive_activations(self, action: Action, position: int) -> Any:
        """RECV_F: ``(payload, labels, constants)`` as sent, or :data:`WAIT`."""

    def send_gradients(self, action: Action, position: int, grads: Sequence[Any]) -> None:
        """SEND_B: the input gradients of ``action.stage`` (None where an input needs none)."""

    def receive_gradients(self, action: Action, position: int) -> Any:
        """RECV_B: the gradients as sent, None kept in place, or :data:`WAIT`."""

    def all_reduce(self, stage: int) -> bool:
        """SYNC: sum the accumulated gradients and sample counts of ``stage``'s replicas into each;
        False while the other replicas have not arrived (then it is asked again)."""

    def sum_tied(self, position: int) -> bool:
        """Before the STEP at ``position``: sum the gradients of the shared parameters due there;
        False while their other holders have not arrived (then it is asked again)."""


class Interpreter:
    """Runs the program of ``rank`` on its stage executors (``{stage: StageExecutor}``).

    It owns what a rank keeps between actions: the outputs and gradients awaiting the next local
    action or a send, the labels of the microbatches passing through, the inputs needing no
    gradient, the losses of the last stage and the measured times.

    Args:
        data: the unit data (read only where stage 0 lives); ``layout`` gives the unit sizes and
            loss scales on every rank.
        on_loss: ``on_loss(k, loss)`` after the last stage's forward of unit ``k``.
        tensors_only: refuse a stage output that is not made of tensors, at the forward (the
            runtime: torch.distributed carries only tensors, and a placement with the next stage
            on the same rank must not accept what another placement refuses).
        faults: errors passed on unchanged (the runtime's communication failures and lost data
            workers, whose exit status tells a supervisor to restart).
        explain: turns a RuntimeError of an action into the error to raise (None: raised as is).
        done: ``done(action)`` after each action (the runtime's status board).
        window: how many actions are timed one by one (default: this rank's of
            :func:`~pipetrain.execution.timing.window_lengths`, which the emulator computes once for all).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        executors: dict[int, StageExecutor],
        data: UnitData | None,
        layout: UnitLayout,
        transport: Transport,
        *,
        on_loss: Callable[[int, float], None] | None = None,
        tensors_only: bool = False,
        faults: tuple[type[BaseException], ...] = (),
        explain: Callable[[int, Action, RuntimeError], BaseException] | None = None,
        done: Callable[[Action], None] | None = None,
        window: int | None = None,
    ) -> None:
        self.schedule = schedule
        self.names = StageNames.of(schedule)  # of a failing stage, in the user's terms
        self.rank = rank
        self.program = schedule.programs[rank]
        self.executors = executors
        self.data = data
        self.layout = layout
        self.transport = transport
        self.on_loss = on_loss
        self.tensors_only = tensors_only
        self.faults = faults
        self.explain = explain
        self.done = done
        self.last_stage = schedule.num_stages - 1
        self.losses: MutableMapping[int, float] = UnitLosses()  # of the units whose last stage runs here
        last_first = schedule.stage_ranks[self.last_stage][0] == rank
        if window is None:
            window = window_lengths(schedule, layout.units_per_update)[rank]
        self.times = ActionTimes(self.program, self.last_stage if last_first else None, window)
        self.releases = version_release_points(self.program)
        self.local: dict[tuple, Any] = {}  # ("F" | "B", receiving stage, unit) -> what the next action takes
        self.labels: dict[int, Any] = {}  # labels of the units passing through this rank
        self.constants: dict[tuple[int, int], int] = {}  # (stage, unit) -> inputs needing no gradient (nonzero)
        self.origin = time.perf_counter()  # timings count from here; pauses move it on

    def run(self, position: int, stop: int) -> int:
        """Run the actions at ``position`` up to (not including) ``stop``; returns where the rank
        stands: ``stop``, or the action whose message or peers the transport is waiting for."""
        rank, program = self.rank, self.program
        executors, transport, layout = self.executors, self.transport, self.layout
        local, labels, constants, releases = self.local, self.labels, self.constants, self.releases
        first_held = min(executors) if executors else 0  # the lowest stage on this rank
        times = self.times
        starts, ends, window, windowed = times.starts, times.ends, times.window, times.windowed
        clock, origin, done = time.perf_counter, self.origin, self.done
        for pc in range(position, stop):
            action = program[pc]
            kind, stage, k, version, _ = action
            began = clock() - origin
            if pc < window:
                starts[pc] = began
            try:
                if kind is _F:
                    self._forward(action, executors[stage])
                elif kind is _B or kind is _I:
                    self._backward(action, first_held)
                elif kind is _FB:  # a pair: on a CPU its halves one after the other, the forward first
                    forward, backward = halves(action)
                    self._forward(forward, executors[forward.stage])
                    self._backward(backward, first_held)
                elif kind is _W:
                    executors[stage].backward_weight(k, version)
                elif kind is _SEND_F:
                    transport.send_activations(action, pc, local.pop(("F", stage + 1, k)), labels[k],
                                               constants.pop((stage + 1, k), 0))
                elif kind is _SEND_B:
                    transport.send_gradients(action, pc, local.pop(("B", stage - 1, k)))
                elif kind is _RECV_F:
                    got = transport.receive_activations(action, pc)
                    if got is WAIT:
                        return pc
                    local[("F", stage, k)], labels[k], sent_constants = got
                    if sent_constants:
                        constants[(stage, k)] = sent_constants
                elif kind is _RECV_B:
                    got = transport.receive_gradients(action, pc)
                    if got is WAIT:
                        return pc
                    local[("B", stage, k)] = got
                elif kind is _SYNC:
                    if not transport.all_reduce(stage):
                        return pc
                elif kind is _STEP:
                    if not transport.sum_tied(pc):
                        return pc
                    executors[stage].step([v for s, v in releases.get(pc, ()) if s == stage])
            except self.faults:
                raise
            except StageError as error:  # a NaN loss, the user's exception: with the step
                raise located(error, rank, action, lambda k: layout.bounds(k)[0], self.names) from None
            except PipetrainError as error:  # located, of its own class (a model's ConfigError stays one)
                error.args = (f"rank {rank}, action {format_action(action)}: {Exception.__str__(error)}",)
                raise error from None
            except RuntimeError as error:
                if self.explain is None:
                    raise
                raise self.explain(rank, action, error) from None
            for release_stage, release_version in releases.get(pc, ()):
                executors[release_stage].release(release_version)
            if done is not None:
                done(action)
            finished = clock() - origin
            if pc < window:
                ends[pc] = finished
            if windowed:
                times.record(action, began, finished)
        return stop

    def _backward(self, action: Action, first_held: int) -> None:
        """B or I: the gradient of the stage's output (the loss on the last stage) back through it."""
        kind, stage, k, version, _ = action
        executor = self.executors[stage]
        local = self.local
        grad_out = None if stage == self.last_stage else local.pop(("B", stage, k))
        if kind is _B:
            grads = executor.backward(k, version, grad_out)
        else:
            grads = executor.backward_input(k, version, grad_out)
        if stage > 0:
            local[("B", stage - 1, k)] = grads
        if stage == first_held or self.schedule.rank_of(stage - 1, k) != self.rank:
            self.labels.pop(k, None)

    def _forward(self, action: Action, executor: StageExecutor) -> None:
        kind, stage, k, version, _ = action
        layout, labels = self.layout, self.labels
        if stage == 0:
            inputs, labels[k] = self.data.unit(k)
        else:
            inputs = self.local.pop(("F", stage, k))
        target = labels[k] if stage == self.last_stage else None
        _, start, stop = layout.bounds(k)
        out = executor.forward(k, version, inputs, target=target, loss_scale=layout.loss_scale(k), samples=stop - start,
                               constants=self.constants.pop((stage, k), 0) if stage else 0)
        if stage != self.last_stage and executor.last_constants:
            self.constants[(stage + 1, k)] = executor.last_constants
        if stage == self.last_stage:
            loss = float(out[0])
            self.losses[k] = loss
            if self.on_loss is not None:
                self.on_loss(k, loss)
            return
        if self.tensors_only:
            for value in flatten(out)[0]:
                if not isinstance(value, torch.Tensor):
                    raise PipetrainError(
                        f"stage {stage} returned a {type(value).__name__}; stages must pass tensors (alone, or in "
                        "tuples, lists and dicts) to the next stage"
                    )
        self.local[("F", stage + 1, k)] = out
