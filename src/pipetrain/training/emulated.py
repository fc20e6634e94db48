"""Training with the emulator: the whole run's schedule executed in one process."""

from __future__ import annotations

import time
from typing import Any

from pipetrain.emulate.emulator import Emulator
from pipetrain.execution.stage import StageExecutor
from pipetrain.execution.timing import measured_timeline
from pipetrain.collector import setup_heap_frozen
from pipetrain.training.evaluate import evaluate_chain
from pipetrain.training.memory_report import MemoryProbe, memory_report
from pipetrain.training.outputs import Progress, UpdateLosses, describe_run, eval_batches, evaluation_line, say
from pipetrain.training.result import TrainResult, loss_scale_report, result_of, scale_payload
from pipetrain.training.setup import Run

__all__ = ["train_emulated", "emulated_result", "chain_forward"]


def chain_forward(executors: list[StageExecutor]):
    """Forward-only pass through the stages in order, on their current weights."""

    def forward(inputs):
        value = inputs
        for executor in executors:
            value = executor.evaluate(value)
        return value

    return forward


def train_emulated(run: Run, callbacks: Any = None) -> TrainResult:
    """Train ``run`` with the single-process emulator; the model ends with the trained weights.
    ``callbacks``: a :class:`~pipetrain.training.callbacks.Callbacks` (losses, evaluations)."""
    schedule = run.schedule
    if not run.config.quiet:
        say(describe_run(run))
    executors = run.make_executors()
    first_replicas = [executors[ranks[0]][stage] for stage, ranks in enumerate(schedule.stage_ranks)]
    data = run.unit_data()
    emulator = Emulator(schedule, executors, data, tied=run.tied)
    held_out = eval_batches(run)
    evaluations: list[dict[str, float]] = []
    progress = Progress(run.updates, run.config.progress, f"{schedule.name} (emulated)")
    losses = UpdateLosses(run, progress, on_update=None if callbacks is None else callbacks.update)

    def evaluate_at(step: int):
        def evaluate() -> None:
            metrics = evaluate_chain(chain_forward(first_replicas), held_out, run.loss_fn)
            evaluations.append({"step": step, **metrics})
            if run.config.eval_every and not run.config.quiet:
                progress.write(evaluation_line(evaluations[-1], run.updates))
            if callbacks is not None:
                callbacks.evaluation(step, metrics)

        return evaluate

    steps = run.evaluation_steps() if len(held_out) else []
    cuts = [(c.positions, evaluate_at(s)) for s, c in zip(steps, run.cuts_after(steps))]

    probe = MemoryProbe(first_replicas[0].device)
    with setup_heap_frozen():
        started = time.perf_counter()
        try:
            emulator.run(losses, cuts=cuts)
        finally:
            progress.close()
            data.close()  # stops the data workers, also when training failed
    seconds = time.perf_counter() - started - emulator.paused
    measured = probe.read()
    for executor in first_replicas:
        executor.write_back()
    if len(held_out) and not run.config.eval_every:
        evaluate_at(run.updates)()
    return emulated_result(run, emulator, executors, losses.losses, seconds, evaluations, measured)


def emulated_result(run: Run, emulator: Emulator, executors: list[list[StageExecutor]], losses: Any,
                    seconds: float, evaluations: list[dict[str, float]], measured: Any) -> TrainResult:
    """The result of an emulated run (by ``fit`` or by the per-step entry): timeline, skipped
    updates, fp16's loss scales and memory beside the losses."""
    schedule = run.schedule
    timeline = measured_timeline(schedule, [t.payload() for t in emulator.times])
    result = result_of(run, "emulate", losses, seconds, timeline, evaluations)
    first_replicas = [executors[ranks[0]][stage] for stage, ranks in enumerate(schedule.stage_ranks)]
    result.extra["skipped_updates"] = [executor.skipped for executor in first_replicas]  # --on-nonfinite skip
    if run.config.precision == "fp16":
        result.extra["loss_scale"] = loss_scale_report(
            [[scale_payload(executors[r][stage]) for r in ranks] for stage, ranks in enumerate(schedule.stage_ranks)])
    result.extra["memory"] = memory_report(run, [measured], per_rank=False)
    return result
