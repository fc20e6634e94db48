"""Memory of one worker of a pipeline stage, per schedule.

What a worker of stage ``s`` holds at its peak (docs/design.md 3.2, 3.3), with ``w`` the stage's parameter
bytes, ``o`` its optimizer-state bytes, ``a`` the activation bytes of all its layers for one
minibatch, ``m`` microbatches per minibatch and
``d_s = ceil(workers from stage s to the end / r_s)``
(for PipeDream ``d_s = W_s + 1``, ``W_s`` the warm-up depth; for a straight pipeline ``S - s``):

==============  ===============  ======================================
schedule        weight versions  activations held
==============  ===============  ======================================
pipedream       d_s              d_s minibatches: ``d_s * a``
2bw             2                min(d_s, m) microbatches of ``a / m``
1f1b, zb-h1     1                min(d_s, m) microbatches of ``a / m``
zb-h2           1                min(2 d_s - 1, m) microbatches of ``a / m``
gpipe           1                all m microbatches: ``a``
interleaved     1 per chunk      from the generated order (below)
bfs             1 per chunk      all m microbatches of every chunk
interleaved-zb  1 per chunk      from the generated order (below)
zb-v            1 per chunk      from the order; per rank about 2R chunk-microbatches (1f1b's 2R at rank 0)
v-half          1 per chunk      from the order; about 1/2 of zb-v's
v-min           1 per chunk      from the order; about 1/3 of zb-v's
dualpipev       1 per chunk      from the order; zb-v's plus one (a pair's forward lands before its backward frees)
==============  ===============  ======================================

plus one copy of the optimizer state.

The chunked schedules (:data:`CHUNKED`: each of R ranks holds several stages of a cut into
``chunks * R``) are not planned by PipeDream's optimizer: their counts depend on the rank's place in
an order no closed form states for every R and m (interleaved's warm-up is cut at m, the V's
ranks hold different mixes of their two chunks), so :func:`order_memory` reads them off the
generated order (:func:`pipetrain.schedule.memory_by_rank`), per stage and per rank, and a rank's
peak is the sum over its chunks of versions x parameter bytes + optimizer bytes, plus its held
activations: the smaller of the sum of each chunk's peak and the rank's peak count of
chunk-microbatches times its largest chunk's (both bound the real peak, which need not be
reached by every chunk at once). Activations are taken to scale linearly with the
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
from functools import lru_cache

import numpy as np

from pipetrain.errors import ConfigError
from pipetrain.schedule import build, memory_by_rank
from pipetrain.schedule.presets import LOOPED

__all__ = ["SCHEDULES", "CHUNKED", "LOOPED_CHUNKS", "SPLIT", "RECOMPUTES", "check_schedule", "is_flush",
           "in_flight", "weight_versions", "stage_memory", "order_memory", "chunks_of", "parse_bytes",
           "format_bytes", "smallest_fitting"]

#: the schedules PipeDream's optimizer partitions (one stage per worker, replicas allowed where the
#: generator has them)
STRAIGHT = ("pipedream", "2bw", "1f1b", "zb-h1", "gpipe", "zb-h2")
#: schedules whose ranks hold several stages each: planned as a cut into ``chunks * ranks`` stages
CHUNKED = ("interleaved", "bfs", "interleaved-zb", "zb-v", "v-half", "v-min", "dualpipev")
SCHEDULES = STRAIGHT + CHUNKED
#: chunks per rank the planner gives the looped schedules (the V schedules always hold 2)
LOOPED_CHUNKS = 2
#: schedules whose backward is split into an input-gradient and a deferred weight-gradient half
SPLIT = frozenset({"zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "interleaved-zb", "dualpipev"})
#: the schedules under which the planner may choose activation recomputation for a stage
RECOMPUTES = ("pipedream", "2bw", "1f1b", "gpipe")
_FLUSH = {"1f1b", "zb-h1", "gpipe", "zb-h2", *CHUNKED}


def check_schedule(name: str) -> str:
    aliases = {"flush": "1f1b", "pipedream-flush": "1f1b", "pipedream-2bw": "2bw", "zbh2": "zb-h2",
               "zbv": "zb-v", "looped-bfs": "bfs", "zb1p": "interleaved-zb", "dualpipe-v": "dualpipev",
               "Interleaved1F1B": "interleaved", "LoopedBFS": "bfs", "InterleavedZeroBubble": "interleaved-zb",
               "ZBVZeroBubble": "zb-v", "DualPipeV": "dualpipev", "GPipe": "gpipe", "1F1B": "1f1b"}
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
    if schedule == "zb-h2":
        return np.minimum(2 * depth - 1, microbatches)
    if schedule in CHUNKED:
        raise ConfigError(f"{schedule} holds several stages per rank: its activations come from its order "
                          f"(order_memory), not from a stage's depth")
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


def smallest_fitting(messages: list[str]) -> tuple[float, str] | None:
    """The smallest "smallest memory limit that fits" among error messages (as :func:`format_bytes`
    writes it, with its bytes), with its text."""
    found = []
    for text in messages:
        match = re.search(r"smallest memory limit that fits is ([^(]+)\((\d+) bytes\)", text)
        if match:
            found.append((float(match.group(2)), match.group(1).strip()))
    return min(found) if found else None


def chunks_of(schedule: str) -> int:
    """Stages each rank holds when the planner plans ``schedule``."""
    return LOOPED_CHUNKS if schedule in LOOPED else \
        2 if schedule in CHUNKED else 1


@lru_cache(maxsize=256)
def order_memory(schedule: str, ranks: int, microbatches: int) -> tuple:
    """Per rank ``(stages, held, versions, rank_held)`` of a chunked schedule over ``ranks`` ranks:
    the stages it holds, each one's peak microbatches held and weight versions, and the rank's peak
    count of microbatches held over all its stages, read off the generated order (module
    docstring). Raises :class:`~pipetrain.errors.ScheduleError` where the generator refuses."""
    built = build(schedule, ranks, microbatches, chunks=chunks_of(schedule) if schedule in
                  LOOPED else 1, communication=False)
    out = []
    for rank, stages in zip(memory_by_rank(built), built.rank_stages()):
        held = tuple(rank.peak_activations.get(s, 0) for s in stages)
        versions = tuple(rank.peak_versions.get(s, 1) for s in stages)
        out.append((tuple(stages), held, versions, rank.rank_peak_activations))
    return tuple(out)


def is_flush(schedule: str) -> bool:
    """True for schedules that drain the pipeline after every minibatch."""
    return schedule in _FLUSH
