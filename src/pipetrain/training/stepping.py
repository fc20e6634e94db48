"""Runs fed one batch at a time by the user's own training loop (``Pipeline.step``).

Each call hands over the batch of the next update and runs every rank as far as it can go
without the batch after it (:func:`~pipetrain.schedule.cuts.feed_cuts`): the same programs, in the
same order, as a whole run, so asynchronous schedules stay full across calls (PipeDream keeps its
warm-up depth of minibatches in flight; nothing flushes between calls) and a call returns the
losses of the updates that finished in it. A run of N updates must know N up front (the
programs, with their drain at the end, are built for it); the last call drains the pipeline.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipetrain.emulate.emulator import Emulator
from pipetrain.errors import ConfigError
from pipetrain.execution.data import UnitLayout
from pipetrain.models.metrics import Metrics
from pipetrain.runtime.errors import collective
from pipetrain.schedule.cuts import feed_cuts
from pipetrain.structure import cast_floating, first_tensor, rows
from pipetrain.training.distributed import RankSetup
from pipetrain.training.emulated import chain_forward, emulated_result
from pipetrain.training.evaluate import evaluate_chain
from pipetrain.training.memory_report import MemoryProbe
from pipetrain.training.outputs import UpdateLosses
from pipetrain.training.result import TrainResult

__all__ = ["FedBatches", "EmulatedSession", "DistributedSession"]


class FedBatches:
    """The batches a training loop hands over, by update, read by the executors unit by unit
    (the interface of :class:`~pipetrain.execution.data.UnitData`). A batch is dropped once each
    of its units has been read ``reads_per_unit`` times."""

    prefetching = False

    def __init__(self, layout: UnitLayout, dtype: torch.dtype, reads_per_unit: int) -> None:
        self.layout = layout
        self.dtype = dtype
        self.reads_per_unit = reads_per_unit
        self._batches: dict[int, tuple[Any, Tensor]] = {}
        self._reads: dict[int, int] = {}

    def feed(self, update: int, inputs: Any, targets: Any) -> None:
        """Hand over update ``update``'s batch; ``targets`` (a tensor or a structure of them) reach the
        loss as given."""
        if not isinstance(targets, (Tensor, tuple, list, dict)):
            targets = torch.as_tensor(targets)
        first = first_tensor(targets)
        size = self.layout.batch_size
        rows = first.shape[0] if first is not None and first.dim() else 0
        if rows != size:
            raise ConfigError(
                f"update {update}: the batch holds {rows} samples but the run was started with batch_size={size}; "
                "every step needs a full batch (drop the last, short one: DataLoader(..., drop_last=True))"
            )
        self._batches[update] = (cast_floating(inputs, self.dtype), targets)
        self._reads[update] = 0

    def batch(self, update: int) -> tuple[Any, Tensor]:
        try:
            return self._batches[update]
        except KeyError:
            raise ConfigError(f"the batch of update {update} was not handed over (call step() once per update)") from None

    def unit(self, unit: int) -> tuple[Any, Tensor]:
        update, start, stop = self.layout.bounds(unit)
        x, y = self.batch(update)
        self._reads[update] += 1
        if self._reads[update] == self.reads_per_unit * self.layout.units_per_update:
            del self._batches[update], self._reads[update]
        if start == 0 and stop == self.layout.batch_size:
            return x, y
        return rows(x, start, stop), rows(y, start, stop)

    def close(self) -> None:
        self._batches.clear()


class _Session:
    """What both executors share: counting updates, collecting finished losses, timing calls."""

    def __init__(self, run, callbacks: Any) -> None:
        self.run = run
        self.callbacks = callbacks
        self.fed = 0
        self.seconds = 0.0  # time spent inside step() calls
        self._finished: list[tuple[int, float]] = []
        self.evaluations: list[dict[str, float]] = []

    def _done(self, update: int, loss: float) -> None:
        self._finished.append((update, loss))
        if self.callbacks is not None:
            self.callbacks.update(update, loss)

    def _next(self) -> int:
        if self.fed >= self.run.updates:
            raise ConfigError(
                f"step() called {self.fed + 1} times but the run was started with steps={self.run.updates}; "
                "start it with more steps"
            )
        return self.fed

    def _take(self) -> list[tuple[int, float]]:
        finished, self._finished = self._finished, []
        return finished

    def _check_finished(self) -> None:
        if self.fed != self.run.updates:
            raise ConfigError(
                f"finish() after {self.fed} of the {self.run.updates} steps the run was started with: the "
                f"programs drain after the last one; call step() {self.run.updates - self.fed} more times"
            )


class EmulatedSession(_Session):
    """A run on the emulator, one update per :meth:`step`."""

    def __init__(self, run, callbacks: Any = None) -> None:
        super().__init__(run, callbacks)
        schedule = run.schedule
        self.executors = run.make_executors()
        self.first_replicas = [self.executors[ranks[0]][stage] for stage, ranks in enumerate(schedule.stage_ranks)]
        # the emulator reads each unit once, at stage 0 (its targets travel on with the activations)
        self.data = FedBatches(run.layout, run.dtype, 1)
        self.emulator = Emulator(schedule, self.executors, self.data, tied=run.tied)
        self.pieces = feed_cuts(schedule, run.layout.units_per_update, run.messages)
        self.losses = UpdateLosses(run, on_update=self._done)

        self.probe = MemoryProbe(self.first_replicas[0].device)  # peak memory from here to finish()
        self.emulator.begin(self.losses)

    def step(self, inputs: Any, targets: Tensor) -> list[tuple[int, float]]:
        update = self._next()
        self.data.feed(update, inputs, targets)
        started = time.perf_counter()
        self.emulator.advance(self.pieces[update])
        self.seconds += time.perf_counter() - started
        self.fed += 1
        return self._take()

    def evaluate(self, batches) -> dict[str, float]:
        metrics = evaluate_chain(chain_forward(self.first_replicas), batches, self.run.loss_fn)
        self.evaluations.append({"step": self.fed, **metrics})
        return metrics

    def finish(self) -> TrainResult:
        self._check_finished()
        self.emulator.end()
        for executor in self.first_replicas:
            executor.write_back()
        measured = self.probe.read()
        return emulated_result(self.run, self.emulator, self.executors, self.losses.losses, self.seconds,
                               self.evaluations, measured)


class _RankPieces:
    """One rank's position of every feed piece (computed when asked, for a long run's pieces)."""

    def __init__(self, pieces, rank: int) -> None:
        self._pieces = pieces if hasattr(pieces, "pattern") else [piece[rank] for piece in pieces]
        self._rank = rank
        self._whole = not hasattr(pieces, "pattern")

    def __getitem__(self, update: int) -> int:
        return self._pieces[update] if self._whole else self._pieces[update][self._rank]

    def __len__(self) -> int:
        return len(self._pieces)


class DistributedSession(_Session):
    """This rank's part of a run on the distributed runtime, one update per :meth:`step`. Every
    rank calls :meth:`step` once per update (only the rank of stage 0 reads the batch it is
    given; the labels travel with the activations)."""

    def __init__(self, run, env, callbacks: Any = None) -> None:
        super().__init__(run, callbacks)
        schedule, rank = run.schedule, env.rank
        held = schedule.rank_stages()[rank]
        data = FedBatches(run.layout, run.dtype, 1) if 0 in held else None
        self.setup = RankSetup(run, env, data=data)
        self.rank = rank
        everyone = feed_cuts(schedule, run.layout.units_per_update, run.messages)
        self.pieces = _RankPieces(everyone, rank)
        self.losses = None
        if rank in schedule.stage_ranks[run.num_stages - 1]:
            self.losses = UpdateLosses(run, rank=rank, on_update=self._done)

        self.probe = MemoryProbe(next(iter(self.setup.executors.values())).device)
        collective("the start barrier", dist.barrier)
        # every piece's end is a pause: no send is waited for across it (the peer may be in user code)
        self.setup.runner.begin(self.losses, pauses=everyone[:-1])

    @property
    def data(self) -> FedBatches | None:
        return self.setup.data

    def step(self, inputs: Any, targets: Tensor | None) -> list[tuple[int, float]]:
        update = self._next()
        if self.data is not None:
            if targets is None:
                raise ConfigError(f"rank {self.rank} holds stage 0: step() needs the batch (inputs and targets)")
            self.data.feed(update, inputs, targets)
        started = time.perf_counter()
        self.setup.runner.advance(self.pieces[update])
        self.seconds += time.perf_counter() - started
        self.fed += 1
        return self._take()

    def evaluate(self, count: int, batch_at) -> dict[str, float] | None:
        """Every rank calls it between the same two steps; the metrics come back on every rank."""
        metrics = self.setup.runner.evaluate(count, batch_at, Metrics(self.run.loss_fn))
        if metrics is not None:
            self.evaluations.append({"step": self.fed, **metrics})
        return metrics

    def finish(self) -> TrainResult:
        self._check_finished()
        runner = self.setup.runner
        runner.end()
        measured = self.probe.read()
        self.setup.close_data()
        self.setup.arrive("the end of training")
        collective("the final barrier", dist.barrier)
        return self.setup.gather(self.setup.payload(self.seconds, self.evaluations) | {"memory": measured})
