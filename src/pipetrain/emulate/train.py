"""Training with the emulator: the whole run's schedule executed in one process."""

from __future__ import annotations

import time

from pipetrain.emulate.executor import Emulator
from pipetrain.execution.stage import StageExecutor
from pipetrain.schedule.ir import Kind
from pipetrain.schedule.timeline import Timeline
from pipetrain.training.evaluate import evaluate_chain
from pipetrain.training.outputs import Progress, eval_batches
from pipetrain.training.result import TrainResult
from pipetrain.training.setup import Run

__all__ = ["train_emulated", "chain_forward"]

_WORK = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP)


def chain_forward(executors: list[StageExecutor]):
    """Forward-only pass through the stages in order, on their current weights."""

    def forward(inputs):
        value = inputs
        for executor in executors:
            value = executor.evaluate(value)
        return value

    return forward


def train_emulated(run: Run) -> TrainResult:
    """Train ``run`` with the single-process emulator; the model ends with the trained weights."""
    schedule = run.schedule
    executors = run.make_executors()
    first_replicas = [executors[ranks[0]][stage] for stage, ranks in enumerate(schedule.stage_ranks)]
    data = run.unit_data()
    emulator = Emulator(schedule, executors, data)
    units = run.layout.units_per_update
    update_losses: list[float] = []
    evaluations: list[dict[str, float]] = []
    held_out = eval_batches(run) if run.config.eval_every else []
    progress = Progress(run.updates, run.config.progress, f"{schedule.name} (emulated)")
    pending: dict[int, float] = {}
    started = time.perf_counter()

    def on_unit(k: int, loss: float) -> None:
        update = k // units
        pending[k] = loss * run.layout.loss_scale(k)
        first = update * units
        if all(u in pending for u in range(first, first + units)):
            update_losses.append(sum(pending.pop(u) for u in range(first, first + units)))
            progress.update(1, update_losses[-1], run.layout.batch_size, time.perf_counter() - started)
            done = len(update_losses)
            every = run.config.eval_every
            if held_out and every and (done % every == 0 or done == run.updates):
                result = evaluate_chain(chain_forward(first_replicas), held_out, run.loss_fn)
                evaluations.append({"step": done, **result})

    try:
        emulator.run(on_unit)
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    for executor in first_replicas:
        executor.write_back()
    if held_out and (not evaluations or evaluations[-1]["step"] != run.updates):
        evaluations.append({"step": run.updates, **evaluate_chain(chain_forward(first_replicas), held_out, run.loss_fn)})
    timeline = Timeline(schedule, emulator.starts, emulator.ends)
    busy = [_busy(timeline, rank) for rank in range(schedule.num_ranks)]
    return TrainResult(
        schedule=schedule.name,
        stages=len(run.staged.stages) if schedule.chunks == 1 else schedule.num_ranks,
        workers=schedule.num_ranks,
        executor="emulate",
        updates=run.updates,
        samples=run.updates * run.layout.batch_size,
        seconds=seconds,
        update_losses=update_losses,
        stage_busy=busy,
        stage_idle=[seconds - b for b in busy],
        evaluations=evaluations,
        timeline=timeline,
        extra={"units_per_update": run.layout.units_per_update},
    )


def _busy(timeline: Timeline, rank: int) -> float:
    return sum(end - start for action, start, end in timeline.spans(rank) if action.kind in _WORK)
