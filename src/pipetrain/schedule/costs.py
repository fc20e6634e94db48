"""Costs that the timeline simulator charges for each action.

Per stage: forward ``F``, input-gradient backward ``B`` and weight-gradient backward ``W`` (a full
backward costs ``B + W``; give ``W = 0`` when the backward is not split), optimizer ``step`` and
gradient all-reduce ``sync`` among replicas. Per message: ``latency + bytes / bandwidth``, where
``bytes`` is the stage's output activation size (the gradient that flows back has the same size),
and ``send`` seconds of sender time.

A value may be one number (every stage) or a list: one entry per stage, or for interleaved and V
schedules one per rank (each of the rank's v chunks then costs 1/v of it) or one per chunk.
Units are free (seconds from a profile, or abstract units); traces treat them as seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence, Union

from pipetrain.errors import ScheduleError, option

__all__ = ["Costs", "StageCosts", "parse_costs", "load_costs"]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

_PER_STAGE = ("F", "B", "W", "step", "sync", "bytes")
_SCALAR = ("latency", "bandwidth", "send")
_ALIASES = {
    "forward": "F",
    "backward": "B",
    "weight": "W",
    "activation_bytes": "bytes",
    "optimizer": "step",
    "allreduce": "sync",
}


@dataclass
class Costs:
    """Action costs as the user gives them (see the module docstring)."""

    F: PerStage = 1.0
    B: PerStage = 2.0
    W: PerStage = 0.0
    step: PerStage = 0.0
    sync: PerStage = 0.0
    bytes: PerStage = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    send: float = 0.0

    def resolve(self, num_stages: int, num_positions: int, chunks: int,
                position_of: Sequence[int] | None = None) -> "StageCosts":
        """Per-stage arrays for a schedule of ``num_stages`` (virtual) stages over ``num_positions``
        pipeline positions with ``chunks`` chunks per rank; ``position_of[s]``: the position (rank)
        of stage s (default ``s % num_positions``, the interleaved placement; a V puts stage s and
        ``2R-1-s`` on one rank)."""
        values = {}
        for name in _PER_STAGE:
            values[name] = _expand(name, getattr(self, name), num_stages, num_positions, chunks, position_of)
        if self.bandwidth <= 0:
            raise ScheduleError(f"bandwidth must be positive, got {self.bandwidth}")
        transfer = [self.latency + b / self.bandwidth if b else self.latency for b in values["bytes"]]
        return StageCosts(
            forward=values["F"],
            backward=values["B"],
            weight=values["W"],
            step=values["step"],
            sync=values["sync"],
            transfer=transfer,
            send=float(self.send),
        )


@dataclass
class StageCosts:
    """Resolved per-(virtual-)stage costs; ``transfer[s]`` is the time a message crossing the
    boundary after stage s spends in flight (either direction)."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    step: list[float]
    sync: list[float]
    transfer: list[float]
    send: float = 0.0
    full_backward: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.full_backward = [b + w for b, w in zip(self.backward, self.weight)]


def _expand(name: str, value: PerStage, num_stages: int, num_positions: int, chunks: int,
            position_of: Sequence[int] | None = None) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
        per_position = chunks > 1 and name not in ("bytes",)
        return [v / chunks for v in values] if per_position else values
    values = [float(v) for v in value]
    if any(v < 0 or math.isnan(v) for v in values):
        raise ScheduleError(f"costs: {name} must be non-negative numbers, got {list(value)}")
    if len(values) == num_stages:
        return values
    if chunks > 1 and len(values) == num_positions:
        scale = 1.0 if name == "bytes" else 1.0 / chunks
        where = position_of if position_of is not None else [s % num_positions for s in range(num_stages)]
        return [values[where[s]] * scale for s in range(num_stages)]
    if len(values) == 1:
        return _expand(name, values[0], num_stages, num_positions, chunks, position_of)
    wanted = f"{num_stages}" if chunks == 1 else f"{num_positions} (one per rank) or {num_stages} (one per chunk)"
    raise ScheduleError(f"costs: {name} has {len(values)} entries but the schedule needs 1 or {wanted}")


def parse_costs(text: str) -> Costs:
    """Parse ``F=1,B=2,W=1[,latency=..,bandwidth=..,bytes=..,step=..,sync=..,send=..]``."""
    costs = Costs()
    if not text.strip():
        return costs
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if not sep or key not in _PER_STAGE + _SCALAR:
            raise ScheduleError(
                f"{option('costs')}: cannot read {item.strip()!r}; write NAME=NUMBER pairs separated by commas with "
                f"NAME one of {', '.join(_PER_STAGE + _SCALAR)}, e.g. {option('costs', 'F=1,B=2,W=1')} (per-stage "
                f"lists go in {option('costs_file')})"
            )
        try:
            number = float(raw)
        except ValueError:
            raise ScheduleError(f"{option('costs')}: {key} must be a number, got {raw.strip()!r}") from None
        if number < 0 or math.isnan(number):
            raise ScheduleError(f"{option('costs')}: {key} must be non-negative, got {raw.strip()}")
        setattr(costs, key, number)
    return costs


def load_costs(path: str) -> Costs:
    """Read a JSON costs file, e.g. ``{"F": [1, 1, 2, 1], "B": [2, 2, 4, 2]}``."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise ScheduleError(f"cannot read costs file {path!r}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ScheduleError(f"costs file {path!r} is not valid JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(data, dict):
        raise ScheduleError(f"costs file {path!r} must hold a JSON object like {{\"F\": [1, 1], \"B\": [2, 2]}}")
    costs = Costs()
    for raw_key, value in data.items():
        key = _ALIASES.get(raw_key, raw_key)
        if key not in _PER_STAGE + _SCALAR:
            raise ScheduleError(
                f"costs file {path!r}: unknown key {raw_key!r}; use {', '.join(_PER_STAGE + _SCALAR)}"
            )
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in _PER_STAGE and isinstance(value, list):
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value) and bool(value)
        if not ok:
            kind = "a number or a list of numbers" if key in _PER_STAGE else "a number"
            raise ScheduleError(f"costs file {path!r}: {raw_key} must be {kind}, got {value!r}")
        setattr(costs, key, value)
    return costs
