"""Training with the emulator: the whole run's schedule executed in one process."""

from __future__ import annotations

import time

from pipetrain.emulate.executor import Emulator
from pipetrain.execution.stage import StageExecutor
from pipetrain.schedule.timeline import Timeline
from pipetrain.training.collector import setup_heap_frozen
from pipetrain.training.evaluate import evaluate_chain
from pipetrain.training.outputs import Progress, UpdateLosses, eval_batches
from pipetrain.training.result import TrainResult, result_of
from pipetrain.training.setup import Run

__all__ = ["train_emulated", "chain_forward"]


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
    held_out = eval_batches(run)
    evaluations: list[dict[str, float]] = []
    progress = Progress(run.updates, run.config.progress, f"{schedule.name} (emulated)")
    losses = UpdateLosses(run, progress)

    def evaluate_at(step: int):
        def evaluate() -> None:
            evaluations.append({"step": step, **evaluate_chain(chain_forward(first_replicas), held_out, run.loss_fn)})

        return evaluate

    steps = run.evaluation_steps() if len(held_out) else []
    cuts = [(c.positions, evaluate_at(s)) for s, c in zip(steps, run.cuts_after(steps))]
    with setup_heap_frozen():
        started = time.perf_counter()
        try:
            emulator.run(losses, cuts=cuts)
        finally:
            progress.close()
            data.close()  # stops the data workers, also when training failed
    seconds = time.perf_counter() - started - emulator.paused
    for executor in first_replicas:
        executor.write_back()
    if len(held_out) and not run.config.eval_every:
        evaluate_at(run.updates)()
    timeline = Timeline(schedule, emulator.starts, emulator.ends)
    return result_of(run, "emulate", losses.losses, seconds, timeline, evaluations)
