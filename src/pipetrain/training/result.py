"""What a training run reports: losses, throughput, evaluation, per-stage busy and idle time."""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainResult", "result_of", "write_json_atomic", "scale_payload", "loss_scale_report"]


def scale_payload(executor: Any) -> dict[str, Any] | None:
    """``--precision fp16``: what a stage executor reports of the loss scale (``None`` without one)."""
    if executor.scaler is None:
        return None
    return {"scales": list(executor.scales), "skipped": list(executor.overflow_skipped)}


def loss_scale_report(payloads: list[Any]) -> dict[str, Any]:
    """``extra["loss_scale"]``: per stage the scale each update used (``scales``, update 1 first) and
    the updates skipped because their gradient overflowed (``skipped``, counted from 1), plus the
    last scale stage 0 used (``final``), whether every stage skipped the same updates
    (``stages_agree``) and whether the replicas of each stage did (``replicas_agree``). A stage's
    entry of ``payloads`` is its payload or the list of its replicas' payloads (first replica first)."""
    replicas = [p if isinstance(p, list) else [p] for p in payloads]
    empty = {"scales": [], "skipped": []}
    stages = [(r[0] if r else None) or empty for r in replicas]
    return {
        "per_stage": stages,
        "final": stages[0]["scales"][-1] if stages and stages[0]["scales"] else None,
        "stages_agree": all(s["skipped"] == stages[0]["skipped"] for s in stages),
        "replicas_agree": all(((p or empty) == first) for r, first in zip(replicas, stages) for p in r),
    }


@dataclass
class TrainResult:
    """The outcome of a run, on any executor."""

    schedule: str
    stages: int
    workers: int
    executor: str
    updates: int
    samples: int
    seconds: float
    update_losses: list[float]
    stage_busy: list[float]
    stage_idle: list[float]
    evaluations: list[dict[str, float]] = field(default_factory=list)
    timeline: Any = None  # a pipetrain.schedule.Timeline of measured times, when recorded
    extra: dict[str, Any] = field(default_factory=dict)
    #: False on the ranks of a distributed run other than rank 0 (same figures, no timeline, and
    #: the model there holds only that rank's stages' trained weights)
    is_main: bool = True

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_loss(self) -> float:
        return self.update_losses[-1] if self.update_losses else float("nan")

    def report(self) -> dict[str, Any]:
        """The `--report-json` object."""
        data = {
            "schedule": self.schedule,
            "stages": self.stages,
            "workers": self.workers,
            "executor": self.executor,
            "steps": self.updates,
            "samples": self.samples,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "final_loss": self.final_loss,
            "losses": self.update_losses,
            "stage_busy_seconds": self.stage_busy,
            "stage_idle_seconds": self.stage_idle,
            "evaluations": self.evaluations,
        }
        if self.evaluations:
            data["final_eval"] = self.evaluations[-1]
        data.update({key: list(value) if isinstance(value, array) else value for key, value in self.extra.items()})
        return data


def result_of(run: Any, executor: str, update_losses: list[float], seconds: float, timeline: Any,
              evaluations: list[dict[str, float]], resumed: int = 0) -> TrainResult:
    """The result of a finished run, with per-rank busy and idle seconds from its measured timeline.
    A run resumed after ``resumed`` updates timed only the others: samples and rates count those."""
    schedule = run.schedule
    busy = [timeline.busy(rank) for rank in range(schedule.num_ranks)]
    extra: dict[str, Any] = {"units_per_update": run.layout.units_per_update}
    ends = _last_stage_updates(timeline)
    if resumed:
        ends = ends[resumed:]
    steady = _steady_rate(run, ends)
    if steady is not None:
        extra["steady_samples_per_s"] = steady
    extra["update_seconds"] = ends  # loss curves against wall time (the updates timed here)
    if resumed:
        extra["resumed_from"] = resumed
    if getattr(run, "stage_choice", None) is not None:
        extra["stage_choice"] = run.stage_choice.as_dict()  # how the stages were chosen, sizes, measured times
    if getattr(run, "data_note", ""):
        extra["data"] = run.data_note  # where the held-out data came from, how batches were read
    return TrainResult(
        schedule=schedule.name,
        stages=len(run.staged.stages) if schedule.chunks == 1 else schedule.num_ranks,
        workers=schedule.num_ranks,
        executor=executor,
        updates=run.updates,
        samples=(run.updates - resumed) * run.layout.batch_size,
        seconds=seconds,
        update_losses=update_losses,
        stage_busy=busy,
        stage_idle=[seconds - b for b in busy],
        evaluations=evaluations,
        timeline=timeline,
        extra=extra,
    )


def _last_stage_updates(timeline: Any) -> list[float]:
    """End times of the last stage's updates (its first replica's STEP actions)."""
    from pipetrain.schedule.ir import Kind

    if getattr(timeline, "update_ends", None) is not None:  # a window of a long run: the whole run's
        return timeline.update_ends  # an array of floats (8 bytes an update), listed in the report
    schedule = timeline.schedule
    last = schedule.num_stages - 1
    rank = schedule.stage_ranks[last][0]
    return [end for action, _, end in timeline.spans(rank) if action.kind is Kind.STEP and action.stage == last]


def _steady_rate(run: Any, ends: list[float], skip: float = 0.25) -> float | None:
    """Samples/s after the first ``skip`` of the updates (start-up excluded): from ``ends``, the end
    times of the last stage's updates (:func:`_last_stage_updates`)."""
    schedule = run.schedule
    last = schedule.num_stages - 1
    first = int(len(ends) * skip)
    if len(ends) - first < 2 or ends[-1] <= ends[first]:
        return None
    units = len(ends) - 1 - first
    samples = units * run.samples_per_update * len(schedule.stage_ranks[last])
    return samples / (ends[-1] - ends[first])


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file and a rename (never a half-written file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)
