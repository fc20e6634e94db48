"""Memory of one worker of a pipeline stage, per schedule.

What a worker of stage ``s`` holds at its peak (docs/design.md 3.2, 3.3), with ``w`` the stage's parameter
bytes, ``o`` its optimizer-state bytes, ``a`` the activation bytes of all its layers for one
minibatch, ``m`` microbatches per minibatch and
``d_s = ceil(workers from stage s to the end / r_s)``
(for PipeDream ``d_s = W_s + 1``, ``W_s`` the warm-up depth; for a straight pipeline ``S - s``):

============  ===============  ======================================
schedule      weight versions  activations held
============  ===============  ======================================
pipedream     d_s              d_s minibatches: ``d_s * a``
2bw           2                min(d_s, m) microbatches of ``a / m``
1f1b, zb-h1   1                min(d_s, m) microbatches of ``a / m``
gpipe         1                all m microbatches: ``a``
============  ===============  ======================================

plus one copy of the optimizer state. Activations are taken to scale linearly with the
microbatch size.

With activation recomputation (``recompute``) a stage keeps only its *input* (``i``, the bytes
crossing the cut into it, per minibatch) for each unit in flight and runs the unit's forward
again in its backward, so it holds the whole activations of one unit at a time: ``d_s * i + a``
(pipedream) or ``min(d_s, m) * i / m + a / m`` (``m * i / m + a / m`` for gpipe); weight versions
are unchanged (the recomputation reads the version its forward read, which these schedules keep
anyway). zb-h1 keeps the graph recomputed for a microbatch's input gradient until its deferred
weight gradient, so a stage holds more graphs the later it is in the pipeline
(:func:`pipetrain.schedule.memory_by_rank` counts them): that is not a function of the stage's
depth alone, and the planner does not recompute under zb-h1 (:data:`RECOMPUTES`). Data entering
stage 0 is counted neither with nor without recomputation.
"""

from __future__ import annotations

import math
import re

import numpy as np

from pipetrain.errors import ConfigError

__all__ = ["SCHEDULES", "RECOMPUTES", "check_schedule", "is_flush", "in_flight", "weight_versions",
           "stage_memory", "parse_bytes", "format_bytes"]

SCHEDULES = ("pipedream", "2bw", "1f1b", "zb-h1", "gpipe")
#: the schedules under which the planner may choose activation recomputation for a stage
RECOMPUTES = ("pipedream", "2bw", "1f1b", "gpipe")
_FLUSH = {"1f1b", "zb-h1", "gpipe"}


def check_schedule(name: str) -> str:
    aliases = {"flush": "1f1b", "pipedream-flush": "1f1b", "pipedream-2bw": "2bw"}
    name = aliases.get(name, name)
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r} for planning; choose one of "
                          f"{', '.join(SCHEDULES)} or auto")
    return name


def in_flight(schedule: str, workers_from_here, replicas, microbatches: int = 1):
    """Minibatches (pipedream) or microbatches (others) whose activations a worker holds."""
    depth = -(-np.asarray(workers_from_here) // np.asarray(replicas))  # ceil division
    if schedule == "pipedream":
        return depth
    if schedule == "gpipe":
        return np.full_like(depth, microbatches)
    return np.minimum(depth, microbatches)


def weight_versions(schedule: str, workers_from_here, replicas):
    """Weight versions a worker keeps."""
    if schedule == "pipedream":
        return -(-np.asarray(workers_from_here) // np.asarray(replicas))
    shape = np.shape(np.asarray(workers_from_here) + np.asarray(replicas))
    return np.full(shape, 2 if schedule == "2bw" else 1)


def stage_memory(schedule: str, *, parameter_bytes, optimizer_bytes, activation_bytes,
                 workers_from_here, replicas, microbatches: int = 1, recompute=False, input_bytes=0.0):
    """Peak bytes on one worker of a stage (broadcasts over array arguments); ``recompute``
    (a bool, or an array of them): with activation recomputation, the stage's ``input_bytes``
    per unit in flight and one unit's activations (see the module docstring)."""
    versions = weight_versions(schedule, workers_from_here, replicas)
    held = in_flight(schedule, workers_from_here, replicas, microbatches)
    per_unit = np.asarray(activation_bytes, dtype=np.float64)
    per_input = np.asarray(input_bytes, dtype=np.float64)
    if schedule != "pipedream":
        per_unit = per_unit / microbatches
        per_input = per_input / microbatches
    kept = np.where(recompute, held * per_input + per_unit, held * per_unit) if np.any(recompute) else \
        held * per_unit
    return versions * np.asarray(parameter_bytes, dtype=np.float64) + \
        np.asarray(optimizer_bytes, dtype=np.float64) + kept


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``16GB`` -> 16e9, ``16GiB`` -> 16 * 2**30, ``1.5e9`` -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}; write e.g. 16GB, 12GiB, 500MB "
                          "or a number of bytes")
    value = float(match.group(1)) * _UNITS[unit]
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"memory size {text!r} must be positive")
    return value


def format_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} B"


def is_flush(schedule: str) -> bool:
    """True for schedules that drain the pipeline after every minibatch."""
    return schedule in _FLUSH
