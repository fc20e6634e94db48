"""What a training run reports: losses, throughput, evaluation, per-stage busy and idle time.

A run's per-update figures (its losses, the end time of each update) are held as arrays of floats,
8 bytes an update, from the ranks that measure them to the report: a list of 100,000 float objects
takes 3.2 MB per copy, and a distributed run has several (rank 0's, the pickled result every rank
gets, the report's). They become lists only where a user asks for one (:attr:`TrainResult.update_losses`,
:meth:`TrainResult.report`); the report file is written from the arrays (:func:`write_json_atomic`).
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from pipetrain.errors import PipetrainError
from pipetrain.training.prediction import prediction
from pipetrain.training.timelines import update_ends

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
    entry of ``payloads`` is the list of its replicas' payloads (first replica first)."""
    replicas = payloads
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
    #: every update's loss, an ``array('d')`` (:attr:`update_losses` lists them)
    losses: array
    stage_busy: list[float]
    stage_idle: list[float]
    evaluations: list[dict[str, float]] = field(default_factory=list)
    timeline: Any = None  # a pipetrain.schedule.Timeline of measured times, when recorded
    extra: dict[str, Any] = field(default_factory=dict)
    #: False on the ranks of a distributed run other than rank 0 (same figures, no timeline, and
    #: the model there holds only that rank's stages' trained weights)
    is_main: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.losses, array):
            self.losses = array("d", self.losses)

    @property
    def update_losses(self) -> list[float]:
        """Every update's loss, as a new list."""
        return self.losses.tolist()

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    def report(self) -> dict[str, Any]:
        """The `--report-json` object, its per-update figures as lists."""
        return {key: value.tolist() if isinstance(value, array) else value for key, value in self._report().items()}

    def write_report(self, path: str) -> None:
        """Write :meth:`report` to ``path`` as JSON (atomically), from the arrays."""
        write_json_atomic(path, self._report())

    def _report(self) -> dict[str, Any]:
        """:meth:`report` with the per-update figures as the arrays they are."""
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
            "losses": self.losses,
            "stage_busy_seconds": self.stage_busy,
            "stage_idle_seconds": self.stage_idle,
            "evaluations": self.evaluations,
        }
        if self.evaluations:
            data["final_eval"] = self.evaluations[-1]
        data.update(self.extra)
        return data


def result_of(run: Any, executor: str, losses: Sequence[float], seconds: float, timeline: Any,
              evaluations: list[dict[str, float]], resumed: int = 0) -> TrainResult:
    """The result of a finished run, with per-rank busy and idle seconds from its measured timeline;
    ``losses``: every update's (an array is kept as it is). A run resumed after ``resumed`` updates
    timed only the others: samples and rates count those."""
    schedule = run.schedule
    busy = [timeline.busy(rank) for rank in range(schedule.num_ranks)]
    extra: dict[str, Any] = {"units_per_update": run.layout.units_per_update}
    ends = _last_stage_updates(timeline)
    if resumed:
        ends = ends[resumed:]
    steady = _steady_rate(run, ends)
    if steady is not None:
        extra["steady_samples_per_s"] = steady
    extra["update_seconds"] = ends if isinstance(ends, array) else array("d", ends)  # loss curves against wall time
    if executor == "distributed":  # ranks in parallel, as the simulator has them (the emulator takes turns)

        try:
            extra.update(prediction(run, timeline, ends))
        except PipetrainError as error:  # a calibration gone since the start: the run's own figures stand
            extra["prediction"] = f"not made: {error}"
    if resumed:
        extra["resumed_from"] = resumed
    if getattr(run, "stage_choice", None) is not None:
        extra["stage_choice"] = run.stage_choice.as_dict()  # how the stages were chosen, sizes, measured times
    if getattr(run, "data_note", ""):
        extra["data"] = run.data_note  # where the held-out data came from, how batches were read
    if getattr(run, "schedule_choice", None) is not None:
        extra["schedule_choice"] = run.schedule_choice.as_dict()  # schedule auto: the candidates' simulated steps
    return TrainResult(
        schedule=schedule.name,
        stages=len(run.staged.stages) if schedule.chunks == 1 else schedule.num_ranks,
        workers=schedule.num_ranks,
        executor=executor,
        updates=run.updates,
        samples=(run.updates - resumed) * run.layout.batch_size,
        seconds=seconds,
        losses=losses if isinstance(losses, array) else array("d", losses),
        stage_busy=busy,
        stage_idle=[seconds - b for b in busy],
        evaluations=evaluations,
        timeline=timeline,
        extra=extra,
    )


def _last_stage_updates(timeline: Any) -> Sequence[float]:
    """End times of the last stage's updates (its first replica's STEP actions)."""
    if getattr(timeline, "update_ends", None) is not None:  # a window of a long run: the whole run's
        return timeline.update_ends  # an array of floats (8 bytes an update), listed in the report
    return update_ends(timeline)


def _steady_rate(run: Any, ends: Sequence[float], skip: float = 0.25) -> float | None:
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
    """Write JSON to ``path`` via a temporary file and a rename (never a half-written file): the
    text of ``json.dump(data, indent=1)``, an ``array`` value of a dictionary ``data`` written as
    the list it holds a slice at a time, never as a list of float objects."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            if isinstance(data, dict):
                for chunk in _dict_chunks(data):
                    handle.write(chunk)
            else:
                json.dump(data, handle, indent=1)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temporary left behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: array items written per chunk of :func:`_dict_chunks`
_SLICE = 4096


def _dict_chunks(data: dict) -> Iterator[str]:
    """The text of ``json.dumps(data, indent=1)`` in pieces, its ``array`` values written from the
    array (each entry is written as ``json`` writes a one-entry dictionary, less its braces)."""
    if not data:
        yield "{}"
        return
    separator = "{\n"
    for key, value in data.items():
        if not isinstance(value, array) or not value:
            yield separator + json.dumps({key: value.tolist() if isinstance(value, array) else value}, indent=1)[2:-2]
        else:
            yield separator + json.dumps({key: []}, indent=1)[2:-4] + "[\n  "
            text = _float_text if value.typecode in "fd" else int.__repr__
            for start in range(0, len(value), _SLICE):
                if start:
                    yield ",\n  "
                yield ",\n  ".join(map(text, value[start:start + _SLICE]))
            yield "\n ]"
        separator = ",\n"
    yield "\n}"


def _float_text(value: float) -> str:
    """A float as ``json`` writes it (``NaN`` and ``Infinity`` included)."""
    if math.isfinite(value):
        return float.__repr__(value)
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
