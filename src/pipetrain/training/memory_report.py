"""Peak memory of a run, measured per process and set beside what the schedule's memory model predicts.

What is measured depends on where the stages compute. On CUDA it is
``torch.cuda.max_memory_allocated`` of the stage's device since the run started (tensors only:
weights, versions, activations, messages, optimizer state). On the CPU it is the peak resident set
size of the process (``resource.getrusage``), which also holds the interpreter, PyTorch's own
libraries and the data, so it is reported with the size at the start of training
(``start_bytes``): the difference is what training added. The distributed runtime measures each
worker process, so each stage gets the figures of the ranks holding it; the emulator runs every
stage in one process, so its stages share that process's figures.

The prediction is :func:`pipetrain.schedule.memory_by_rank` of the run's schedule, with
recomputation when the run recomputes: microbatches whose activations are held at once (and
inputs kept for recomputation) and weight versions alive at once, per stage; and in bytes,
``predicted_bytes``, what training adds above the start (:func:`pipetrain.schedule.bytes_by_rank`):
gradient sums, optimizer state, weight versions beyond the first and the activations in flight,
each microbatch's sized on the meta device (:func:`~pipetrain.training.shapes.microbatch_bytes`).
With a calibration (``--costs-file``) each process also gets the calibration's ``worker_bytes``,
what a worker adds whatever the model (the libraries' and the transport's buffers on first use).
Set beside ``peak_bytes - start_bytes``. Not in it: the allocator's slack, temporaries of one
operation (an optimizer step's, a kernel's workspace), messages queued in the transport and the
data loader's batches; on the CPU also what the interpreter and libraries allocate on first use.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import torch

from pipetrain.execution.update_in_backward import can_update_in_backward, update_wanted
from pipetrain.schedule.memory import StageSizes, bytes_by_rank, memory_by_rank
from pipetrain.schedule.recompute_stages import format_recompute
from pipetrain.schedule.timeline import positions
from pipetrain.training.run import Run
from pipetrain.training.shapes import microbatch_bytes
from pipetrain.training.validate import loss_scale_of

__all__ = ["MemoryProbe", "memory_report", "predicted_bytes"]


def _rss_now() -> int | None:
    """The resident set size of this process now, in bytes (Linux), else ``None``."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None

    return pages * os.sysconf("SC_PAGE_SIZE")


def _rss_peak() -> int | None:
    """The peak resident set size of this process so far, in bytes (``None`` where unknown)."""
    try:
        import resource  # imported here: Unix only, tried where it is needed
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _reset_rss_peak() -> bool:
    """Start the kernel's high-water mark of this process's resident set again from its size now
    (Linux 4.0 and later: ``/proc/self/clear_refs``); False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    return _rss_since_reset() is not None


def _rss_since_reset() -> int | None:
    """The high-water mark of the resident set (``VmHWM``), in bytes, or ``None``."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryProbe:
    """Started before training on ``device``, read after it: this process's peak memory during
    training. On the CPU the kernel's high-water mark is reset at the start where Linux allows it
    (else the process's lifetime peak, set-up's transient peak included, is all there is)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.since_start = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = _rss_now()
            self.since_start = _reset_rss_peak()

    def read(self) -> dict[str, Any]:
        """``{"measure", "device", "peak_bytes", "start_bytes"}``."""
        if self.device.type == "cuda":
            return {"measure": "cuda_max_memory_allocated", "device": str(self.device),
                    "peak_bytes": int(torch.cuda.max_memory_allocated(self.device)), "start_bytes": int(self.start)}
        # Linux updates the high-water mark lazily (when the set shrinks), so the set as it is now
        # may stand above it: the peak is at least that
        peak = _rss_since_reset() if self.since_start else _rss_peak()
        peaks = [value for value in (peak, _rss_now()) if value is not None]
        return {"measure": "peak_rss" if self.since_start else "peak_rss_of_the_process",
                "device": str(self.device), "peak_bytes": max(peaks) if peaks else None, "start_bytes": self.start}


def memory_report(run: Any, measured: Sequence[dict[str, Any]], *, per_rank: bool) -> dict[str, Any]:
    """The report's ``memory`` object: per stage, the measured figures of the processes holding it
    (``measured[rank]``, or one figure for every stage when not ``per_rank``: the emulator) and
    the memory model's prediction."""
    schedule = run.schedule
    recompute = frozenset(getattr(run, "recompute", ()))
    model = memory_by_rank(schedule, recompute=recompute)
    predicted = predicted_bytes(run, recompute)
    worker = _worker_bytes(run)
    held_stages = schedule.rank_stages()
    stages = []
    for position, ranks in enumerate(positions(schedule)):
        figures = [measured[r] if per_rank else measured[0] for r in ranks]
        peaks = [f["peak_bytes"] for f in figures if f.get("peak_bytes") is not None]
        starts = [f["start_bytes"] for f in figures if f.get("start_bytes") is not None]
        held = [model[r] for r in ranks]
        if schedule.chunks > 1:  # a rank's chunks share its memory: the rank's figures
            activations = max(m.rank_peak_activations for m in held)
            inputs = max(sum(m.peak_inputs.values()) for m in held)
            versions = max(sum(m.peak_versions.values()) for m in held)
        else:
            activations = max(m.peak_activations.get(position, 0) for m in held)
            inputs = max(m.peak_inputs.get(position, 0) for m in held)
            versions = max(m.peak_versions.get(position, 1) for m in held)
        entry = {
            "stage": position,
            "ranks": list(ranks),
            "peak_bytes": max(peaks) if peaks else None,
            "start_bytes": max(starts) if starts else None,
            "predicted_peak_activations": activations,
            "predicted_peak_versions": versions,
        }
        if any(recompute.intersection(held_stages[r]) for r in ranks):
            entry["predicted_peak_inputs"] = inputs
        if predicted is not None:
            entry["predicted_bytes"] = max(predicted[r]["total"] for r in ranks) + (worker if per_rank else 0)
            entry["predicted_parts"] = {**predicted[ranks[0]], **({"worker": worker} if per_rank and worker else {})}
        stages.append(entry)
    first = measured[0] if measured else {}
    out = {
        "measure": first.get("measure"),
        "per": "process of each rank" if per_rank else "the one process of every stage (emulator)",
        "recompute": format_recompute(recompute, schedule.num_stages),
        "stages": stages,
    }
    if predicted is not None and not per_rank:  # one process holds every rank's part (an upper bound: peaks apart)
        out["predicted_bytes"] = sum(p["total"] for p in predicted) + worker
    return out


def _worker_bytes(run: Run) -> int:
    """The calibration's ``worker_bytes`` (0 without one)."""
    calibration = run.calibration
    return int(calibration.worker_bytes) if calibration is not None else 0


def predicted_bytes(run: Run, recompute: frozenset[int] = frozenset()) -> list[dict[str, int]] | None:
    """Per rank, :func:`pipetrain.schedule.bytes_by_rank` of the run's schedule with its stages'
    sizes (trainable parameters, the optimizer's state slots, a microbatch's held bytes); None
    where a microbatch cannot be sized (see :func:`~pipetrain.training.shapes.microbatch_bytes`)."""
    stages = run.staged.stages
    if len(stages) != run.schedule.num_stages:
        return None
    held = microbatch_bytes(run)
    if held is None:
        return None
    sizes = []
    scaler, units = loss_scale_of(run.config), run.layout.units_per_update
    for index, (module, microbatch) in enumerate(zip(stages, held)):
        trainable = [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad]
        optimizer = run.stage_optimizer(index)
        slots = getattr(optimizer, "state_slots", 0) or 0
        # an update made during the backward frees each gradient once read (one at a time)
        fused = can_update_in_backward(optimizer) and update_wanted(
            run.updates_in_backward(index), units, scaler, run.config.on_nonfinite)
        sizes.append(StageSizes(sum(trainable), slots * sum(trainable), microbatch.held, microbatch.inputs,
                                gradients=max(trainable, default=0) if fused else None))
    return bytes_by_rank(run.schedule, sizes, recompute=recompute)
