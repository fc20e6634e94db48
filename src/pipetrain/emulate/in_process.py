"""The emulator's transport: messages between the ranks of one process, in memory.

A message is delivered into a mailbox under (direction, receiving stage, unit), so a receive
finds it whatever the order of the sends; the exact tensors travel, never copies. A receive
whose message is not there, a SYNC whose replicas have not all arrived and a STEP whose shared
parameters' other holders have not, answer :data:`~pipetrain.execution.interpreter.WAIT` and
note the rank: the :class:`Mailboxes` call ``wake(rank)`` when what it waits for arrives, and
the emulator then runs that rank again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipetrain.execution.interpreter import WAIT
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.tied_gradients import TiedGradients, gradient_of
from pipetrain.schedule.ir import Action, Schedule

__all__ = ["InProcessTransport", "Mailboxes", "all_reduce_sum"]


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


class Mailboxes:
    """What the ranks of one process share: the messages in flight, who waits for which, and the
    rendezvous of SYNC and of shared-parameter sums.

    Args:
        executors: ``executors[rank][stage]``, as the emulator holds them (collectives read the
            replicas of every rank).
        wake: ``wake(rank)`` when something ``rank`` waits for has arrived.
        tied: where the stages sharing a parameter sum its gradient.
    """

    def __init__(
        self,
        schedule: Schedule,
        executors: Sequence[dict[int, StageExecutor]],
        wake: Callable[[int], None],
        tied: TiedGradients | None = None,
    ) -> None:
        self.schedule = schedule
        self.executors = executors
        self.wake = wake
        self.tied = tied if tied else None
        self.messages: dict[tuple[str, int, int], Any] = {}  # (direction, receiving stage, unit) -> payload
        self.waiting: dict[tuple[str, int, int], int] = {}  # the same key -> the rank waiting for it
        self.syncs: dict[tuple[int, int], list] = {}  # (stage, its n-th SYNC) -> [ranks there, summed]
        self.syncs_seen: dict[tuple[int, int], int] = {}  # (rank, stage) -> SYNCs the rank has passed
        self.tied_arrived: dict[tuple[int, int], set[int]] = {}  # (parameter, occurrence) -> ranks there
        self.tied_summed: set[tuple[int, int]] = set()

    def restart(self) -> None:
        """Forget the messages and SYNCs of an earlier run (the sums of shared parameters stay done)."""
        self.messages.clear()
        self.waiting.clear()
        self.syncs.clear()
        self.syncs_seen.clear()

    def transport(self, rank: int) -> InProcessTransport:
        """The transport of ``rank``'s interpreter."""
        return InProcessTransport(self, rank)

    def deliver(self, key: tuple[str, int, int], value: Any) -> None:
        self.messages[key] = value
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            self.wake(waiter)

    def collect(self, key: tuple[str, int, int], rank: int) -> Any:
        if key not in self.messages:
            self.waiting[key] = rank
            return WAIT
        return self.messages.pop(key)


class InProcessTransport:
    """One rank's side of the :class:`Mailboxes` (a :class:`~pipetrain.execution.interpreter.Transport`)."""

    def __init__(self, mailboxes: Mailboxes, rank: int) -> None:
        self.mailboxes = mailboxes
        self.rank = rank

    def send_activations(self, action: Action, position: int, payload: Any, labels: Any, constants: int) -> None:
        self.mailboxes.deliver(("F", action.stage + 1, action.microbatch), (payload, labels, constants))

    def receive_activations(self, action: Action, position: int) -> Any:
        return self.mailboxes.collect(("F", action.stage, action.microbatch), self.rank)

    def send_gradients(self, action: Action, position: int, grads: Sequence[Any]) -> None:
        self.mailboxes.deliver(("B", action.stage - 1, action.microbatch), grads)

    def receive_gradients(self, action: Action, position: int) -> Any:
        return self.mailboxes.collect(("B", action.stage, action.microbatch), self.rank)

    def all_reduce(self, stage: int) -> bool:
        """The last replica to arrive sums (:func:`all_reduce_sum`) and wakes the others."""
        boxes, rank = self.mailboxes, self.rank
        index = boxes.syncs_seen.get((rank, stage), 0)
        state = boxes.syncs.setdefault((stage, index), [set(), False])
        if not state[1]:
            state[0].add(rank)
            replicas = boxes.schedule.stage_ranks[stage]
            if len(state[0]) < len(replicas):
                return False
            all_reduce_sum([boxes.executors[r][stage] for r in replicas])
            state[1] = True
            for other in replicas:
                if other != rank:
                    boxes.wake(other)
        boxes.syncs_seen[(rank, stage)] = index + 1
        return True

    def sum_tied(self, position: int) -> bool:
        """A rendezvous of the ranks holding each shared parameter summed here; the last to
        arrive sums the gradients and wakes the others."""
        boxes, rank = self.mailboxes, self.rank
        tied, executors = boxes.tied, boxes.executors
        if tied is None:
            return True
        ready = True
        for key in tied.due(rank, position):
            if key in boxes.tied_summed:
                continue
            t = key[0]
            arrived = boxes.tied_arrived.setdefault(key, set())
            arrived.add(rank)
            if len(arrived) < len(tied.ranks[t]):
                ready = False
                continue
            first = boxes.schedule.stage_ranks
            total = tied.total(t, lambda stage, name: gradient_of(executors[first[stage][0]][stage], name))
            tied.assign(t, total, [e for r in tied.ranks[t] for e in executors[r].values()])
            del boxes.tied_arrived[key]
            boxes.tied_summed.add(key)
            for other in tied.ranks[t]:
                if other != rank:
                    boxes.wake(other)
        return ready
