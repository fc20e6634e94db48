"""Costs that the timeline simulator charges for each action.

Per stage: forward ``F``, input-gradient backward ``B`` and weight-gradient backward ``W`` (a full
backward costs ``B + W``, or ``full`` where given: a measured order that runs some backwards whole
and splits others, DualPipe's, has both; give ``W = 0`` when the backward is not split), optimizer ``step`` and
gradient all-reduce ``sync`` among replicas. Per message: ``latency + bytes / bandwidth`` in
flight, where ``bytes`` is the stage's output activation size (the gradient that flows back has
the same size); the sender is busy ``send + bytes * send_per_byte`` (packing it, handing it to the
transport: on a CPU whose core the rank has to itself that work is not overlapped with compute)
and the receiver ``recv + bytes * recv_per_byte`` once it has arrived. ``quantum``: where the
transport moves a message on the sender's own core (gloo on a CPU whose core the rank has to
itself), a message leaves only when its sender next waits (a RECV or SYNC, or its program's end)
or after ``quantum`` seconds, when the operating system gives the transport its turn; 0 (the
default): it leaves at once, as on a transport of its own (NCCL). ``overhead``: the runner's own
time before every action (the interpreter between actions). ``pipetrain calibrate`` measures
the scalar ones on the machine and transport it runs on (:mod:`pipetrain.runtime.calibrate`).

A value may be one number (every stage) or a list: one entry per stage, or for interleaved and V
schedules one per rank (each of the rank's v chunks then costs 1/v of it) or one per chunk.
Units are free (seconds from a profile, or abstract units); traces treat them as seconds.
"""

from __future__ import annotations

import json
import math
import os
import platform
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Sequence, Union

from pipetrain.errors import ScheduleError, option

__all__ = ["Costs", "StageCosts", "parse_costs", "load_costs", "load_calibration", "machine_facts"]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

_PER_STAGE = ("F", "B", "W", "step", "sync", "bytes")
_SCALAR = ("latency", "bandwidth", "send", "send_per_byte", "recv", "recv_per_byte", "quantum", "overhead",
           "sync_per_byte", "step_per_byte", "worker_bytes")
#: what a calibration adds to costs built elsewhere (:meth:`Costs.charging`): per message and per action
CHARGED = ("latency", "send", "send_per_byte", "recv", "recv_per_byte", "quantum", "overhead")
#: per-stage figures that a rank's chunks do not share out (a time is split among them)
_NOT_SHARED = ("bytes", "bandwidth")
#: what a calibration file says about where it was measured (not costs): checked, not charged
_ABOUT = ("measured_on",)
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
    #: a full backward's own time per stage, where it is not B + W (None: B + W)
    full: PerStage | None = None
    step: PerStage = 0.0
    sync: PerStage = 0.0
    bytes: PerStage = 0.0
    latency: float = 0.0
    #: bytes per second in flight: one number, or per stage boundary (the level of a topology a cut
    #: crosses)
    bandwidth: PerStage = math.inf
    send: float = 0.0
    send_per_byte: float = 0.0
    recv: float = 0.0
    recv_per_byte: float = 0.0
    quantum: float = 0.0
    overhead: float = 0.0
    #: a calibration's all-reduce and optimizer step per byte of a stage's parameters: not charged
    #: here (the simulator knows no parameter sizes); a caller that knows them adds
    #: ``sync_per_byte * bytes`` to ``sync`` and makes ``step`` ``step_per_byte * bytes``
    sync_per_byte: float = 0.0
    step_per_byte: float = 0.0
    #: a calibration's memory that a training worker adds above its start whatever the model (the
    #: libraries' and the transport's buffers on first use): not a time; the memory report adds it
    worker_bytes: float = 0.0
    #: where a calibration measured these (machine, torch, transport), None for given costs
    measured_on: dict | None = None

    def charging(self, calibration: "Costs") -> "Costs":
        """These costs with ``calibration``'s per-message and per-action scalars (busy times,
        latency, quantum, overhead; ``pipetrain calibrate``'s), set in place; the bandwidth, the
        sizes and the compute stay these costs' own."""
        for name in CHARGED:
            setattr(self, name, getattr(calibration, name))
        return self

    def resolve(self, num_stages: int, num_positions: int, chunks: int,
                position_of: Sequence[int] | None = None) -> "StageCosts":
        """Per-stage arrays for a schedule of ``num_stages`` (virtual) stages over ``num_positions``
        pipeline positions with ``chunks`` chunks per rank; ``position_of[s]``: the position (rank)
        of stage s (default ``s % num_positions``, the interleaved placement; a V puts stage s and
        ``2R-1-s`` on one rank)."""
        values = {}
        for name in _PER_STAGE + ("bandwidth",):
            values[name] = _expand(name, getattr(self, name), num_stages, num_positions, chunks, position_of)
        if min(values["bandwidth"]) <= 0:
            raise ScheduleError(f"bandwidth must be positive, got {self.bandwidth}")
        transfer = [self.latency + b / w if b else self.latency for b, w in zip(values["bytes"], values["bandwidth"])]
        whole = None if self.full is None else _expand("full", self.full, num_stages, num_positions, chunks,
                                                       position_of)
        return StageCosts(
            forward=values["F"],
            backward=values["B"],
            weight=values["W"],
            full_backward=whole,
            step=values["step"],
            sync=values["sync"],
            transfer=transfer,
            sending=[self.send + b * self.send_per_byte for b in values["bytes"]],
            receiving=[self.recv + b * self.recv_per_byte for b in values["bytes"]],
            overhead=float(self.overhead),
            quantum=float(self.quantum),
        )


@dataclass
class StageCosts:
    """Resolved per-(virtual-)stage costs; ``transfer[s]`` is the time a message crossing the
    boundary after stage s spends in flight (either direction), ``sending[s]`` and ``receiving[s]``
    the time its sender and its receiver are busy with it; ``overhead`` the runner's time before
    every action; ``quantum`` the longest a sent message waits for its sender to wait (see the
    module docstring)."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    step: list[float]
    sync: list[float]
    transfer: list[float]
    sending: list[float] = field(default_factory=list)
    receiving: list[float] = field(default_factory=list)
    overhead: float = 0.0
    quantum: float = 0.0
    #: a full backward's time per stage (default ``backward + weight``)
    full_backward: list[float] | None = None

    def __post_init__(self) -> None:
        if self.full_backward is None:
            self.full_backward = [b + w for b, w in zip(self.backward, self.weight)]
        self.sending = self.sending or [0.0] * len(self.transfer)
        self.receiving = self.receiving or [0.0] * len(self.transfer)


def _expand(name: str, value: PerStage, num_stages: int, num_positions: int, chunks: int,
            position_of: Sequence[int] | None = None) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
        per_position = chunks > 1 and name not in _NOT_SHARED
        return [v / chunks for v in values] if per_position else values
    values = [float(v) for v in value]
    if any(v < 0 or math.isnan(v) for v in values):
        raise ScheduleError(f"costs: {name} must be non-negative numbers, got {list(value)}")
    if len(values) == num_stages:
        return values
    if chunks > 1 and len(values) == num_positions:
        scale = 1.0 if name in _NOT_SHARED else 1.0 / chunks
        where = position_of if position_of is not None else [s % num_positions for s in range(num_stages)]
        return [values[where[s]] * scale for s in range(num_stages)]
    if len(values) == 1:
        return _expand(name, values[0], num_stages, num_positions, chunks, position_of)
    wanted = f"{num_stages}" if chunks == 1 else f"{num_positions} (one per rank) or {num_stages} (one per chunk)"
    raise ScheduleError(f"costs: {name} has {len(values)} entries but the schedule needs 1 or {wanted}")


def parse_costs(text: str) -> Costs:
    """Parse ``F=1,B=2,W=1[,latency=..,bandwidth=..,bytes=..,step=..,sync=..,send=..,overhead=..]``."""
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
        if key in _ABOUT:
            if not isinstance(value, dict) or not all(isinstance(v, (str, int)) for v in value.values()):
                raise ScheduleError(f"costs file {path!r}: {raw_key} must be an object of names and values, "
                                    f"got {value!r}")
            costs.measured_on = dict(value)
            continue
        if key not in _PER_STAGE + _SCALAR:
            raise ScheduleError(
                f"costs file {path!r}: unknown key {raw_key!r}; use {', '.join(_PER_STAGE + _SCALAR)}"
            )
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in _PER_STAGE and isinstance(value, list):
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value) and bool(value)
        if ok and key in _SCALAR and (value < 0 or math.isnan(value)):
            raise ScheduleError(f"costs file {path!r}: {raw_key} must be non-negative, got {value!r}")
        if not ok:
            kind = "a number or a list of numbers" if key in _PER_STAGE else "a number"
            raise ScheduleError(f"costs file {path!r}: {raw_key} must be {kind}, got {value!r}")
        setattr(costs, key, value)
    if costs.measured_on is not None:
        _warn_if_elsewhere(path, costs.measured_on)
    return costs


def load_calibration(path: str | None) -> Costs | None:
    """A run's ``costs_file`` (None: none), warning each time it is read if it was measured
    elsewhere (Python would show a warning from one place only once per process)."""
    if not path:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        return load_costs(path)


def machine_facts() -> dict[str, str | int]:
    """What a calibration says about where it ran: host, processor, cores and torch's version
    (read without importing torch)."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = "none"
    return {"host": platform.node(), "processor": _processor(), "cores": os.cpu_count() or 0, "torch": version}


def _processor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _warn_if_elsewhere(path: str, measured_on: dict) -> None:
    """A calibration is used where it was not measured with a warning that names both (its
    figures may not hold here)."""
    here = machine_facts()
    differ = [key for key in ("host", "processor", "cores", "torch")
              if key in measured_on and str(measured_on[key]) != str(here[key])]
    if differ:
        warnings.warn(
            f"costs file {path!r} was measured on {', '.join(f'{k} {measured_on[k]}' for k in differ)}; this is "
            f"{', '.join(f'{k} {here[k]}' for k in differ)}: its figures may not hold here (run pipetrain calibrate "
            f"again)", stacklevel=2)
