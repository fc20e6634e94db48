"""Schedules exchanged with torch.distributed.pipelining as its CSV files.

torch writes a schedule (``_PipelineScheduleRuntime._dump_csv``) as one CSV row per rank and one
cell per time step, in one of two formats:

* ``compute_only``: ``0F3`` (stage 0, forward of microbatch 3), ``7I2`` / ``7W2`` (input / weight
  gradient), ``4B1`` (full backward), ``(0F7;7B3)OVERLAP_F_B`` (a pair, :func:`~pipetrain.
  schedule.ir.pair`), and empty cells where a rank idles;
* ``compute_comms``: the same with its communication, ``1SEND_F3``, ``2RECV_F3``, ``2SEND_B1``,
  ``1RECV_B1``, and FSDP's ``0UNSHARD`` / ``0RESHARD`` and ``0REDUCE_GRAD``, which have no
  counterpart here and are dropped (pipetrain applies a stage's update with ``STEP`` at the end of
  its rank's program; torch's optimizer step is outside the schedule). torch's RECV is where the
  receive is *posted*; pipetrain's is where the data is *needed*, so each moves to just before the
  action consuming it (sends stay where they are).

Like torch (``_validate_schedule``), a stage lives on the rank whose row computes it, each stage
on one rank; torch's builders place them in a loop (stage s on rank ``s % P``, style "loop") or
in a V (rank r holds r and ``2P - 1 - r``, style "v"), and the file says which by its actions.
A file holds one step of ``m`` microbatches, ``m`` being the forwards of stage 0. Whatever cannot
be run is refused naming the row (rank + 1) and cell (1-based), before anything runs.

:func:`dumps` writes the ``compute_only`` file that ``_PipelineScheduleRuntime._load_csv`` reads.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.ir import Action, Kind, Schedule, halves, pair
from pipetrain.schedule.ir import loads as loads_pipetrain
from pipetrain.schedule.lower import add_communication
from pipetrain.schedule.versions import assign_versions
from pipetrain.schedule.vshape import v_placement

__all__ = ["loads", "load", "dumps", "dump", "is_torch", "read", "placement_style"]

_SINGLE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|I|B|W)(\d*)$")
_PAIR = re.compile(r"^\(([^()]*)\)OVERLAP_F_B$")
_COMPUTE = {"F": Kind.F, "I": Kind.I, "B": Kind.B, "W": Kind.W}
_COMMS = {"SEND_F": Kind.SEND_F, "RECV_F": Kind.RECV_F, "SEND_B": Kind.SEND_B, "RECV_B": Kind.RECV_B}
_DROPPED = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})
_EXAMPLES = "e.g. 0F3, 7I2, 7W2, 4B1, (0F7;7B3)OVERLAP_F_B, 1SEND_F3, 2RECV_B1, or an empty cell"


class _Cell:
    """Where an action came from: for messages naming the row and cell."""

    __slots__ = ("rank", "column", "text")

    def __init__(self, rank: int, column: int, text: str) -> None:
        self.rank, self.column, self.text = rank, column, text

    def __str__(self) -> str:
        return f"row {self.rank + 1} (rank {self.rank}), cell {self.column + 1} ({self.text!r})"


def is_torch(text: str) -> bool:
    """Whether ``text`` is torch's CSV rather than pipetrain's text form (whose lines start with a
    ``#`` header or a rank number)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or any(line.startswith("#") for line in lines):
        return False
    return not all(line.split(",", 1)[0].strip().isdigit() for line in lines)


def read(path: str) -> Schedule:
    """A schedule file of either form: torch's CSV (:func:`load`) or pipetrain's (``ir.load``)."""
    text = _text(path)
    return loads(text, source=path) if is_torch(text) else loads_pipetrain(text)


def load(path: str) -> Schedule:
    """Read torch's CSV file at ``path`` (see :func:`loads`)."""
    return loads(_text(path), source=path)


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            return handle.read()
    except OSError as error:
        raise ScheduleError(f"cannot read schedule file {path!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{path!r} is not a schedule: it is not text (a CSV of actions, one row per rank)") from None


def _parse_cell(text: str, where: _Cell, source: str) -> tuple[str, Action | None]:
    """``(kind name, action)`` of one cell; the action is None for an empty cell or a dropped one."""
    paired = _PAIR.match(text)
    if paired is not None:
        parts = [part.strip() for part in paired[1].split(";")]
        halves_ = [_parse_cell(part, where, source)[1] for part in parts]
        if (len(halves_) != 2 or halves_[0] is None or halves_[1] is None or halves_[0].kind is not Kind.F
                or halves_[1].kind not in (Kind.B, Kind.I)):
            raise ScheduleError(f"{source} {where}: a pair must be a forward and then a backward, e.g. "
                                "(0F7;7B3)OVERLAP_F_B")
        return "OVERLAP_F_B", pair(halves_[0], halves_[1])
    match = _SINGLE.match(text)
    if match is None:
        raise ScheduleError(f"{source} {where}: not one of torch's schedule actions ({_EXAMPLES})")
    stage, name, microbatch = int(match[1]), match[2], match[3]
    if name in _DROPPED:
        return name, None
    if not microbatch:
        raise ScheduleError(f"{source} {where}: {name} needs a microbatch number, e.g. {stage}{name}0")
    kind = _COMPUTE.get(name) or _COMMS[name]
    return name, Action(kind, stage, int(microbatch))


def loads(text: str, *, source: str = "the schedule") -> Schedule:
    """The schedule of torch's CSV ``text``, checked as torch's runtime would need it, with a flush
    version policy, a STEP per stage at the end of its rank's program and, for a compute_only
    file, the communication :func:`~pipetrain.schedule.lower.add_communication` adds."""
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError(f"{source} is not a schedule: it has no rows (torch's CSV has one row of actions per rank)")
    programs: list[list[tuple[Action, _Cell]]] = []
    comms = False
    for rank, row in enumerate(rows):
        program = []
        for column, raw in enumerate(row):
            cell = raw.strip()
            if not cell:
                continue
            where = _Cell(rank, column, cell)
            name, action = _parse_cell(cell, where, source)
            comms = comms or name in _COMMS or name in _DROPPED
            if action is not None:
                program.append((action, where))
        programs.append(program)
    placement = _placement(programs, source)
    microbatches = _check_work(programs, placement, source)
    compute_only = not any(action.kind in _COMMS.values() for program in programs for action, _ in program)
    out = []
    for rank, program in enumerate(programs):
        actions = _receive_where_needed([action for action, _ in program])
        held = sorted(stage for stage, owner in enumerate(placement) if owner == rank)
        actions.extend(Action(Kind.STEP, stage) for stage in held)
        out.append(actions)
    schedule = Schedule(out, [[rank] for rank in placement], name="torch", policy="flush", microbatches=microbatches,
                        steps=1, chunks=max(1, len(placement) // len(programs)),
                        meta={"format": "compute_comms" if comms else "compute_only",
                              "style": placement_style(placement, len(programs))})
    schedule = assign_versions(schedule, "flush")
    return add_communication(schedule) if compute_only else schedule


def _placement(programs: Sequence[Sequence[tuple[Action, _Cell]]], source: str) -> list[int]:
    """``placement[stage]``: the rank computing it, each stage on one rank, stages 0..N-1."""
    owner: dict[int, tuple[int, _Cell]] = {}
    for rank, program in enumerate(programs):
        for action, where in program:
            for half in halves(action):
                if half.kind in (Kind.F, Kind.B, Kind.I, Kind.W):
                    seen = owner.setdefault(half.stage, (rank, where))
                    if seen[0] != rank:
                        raise ScheduleError(
                            f"{source} {where}: stage {half.stage} runs on rank {rank} here but on rank {seen[0]} at "
                            f"{seen[1]}; torch places each stage on one rank")
    if not owner:
        raise ScheduleError(f"{source} is not a schedule: no row has a forward or backward (e.g. 0F0, 0B0)")
    count = max(owner) + 1
    for stage in range(count):
        if stage not in owner:
            later = min(s for s in owner if s > stage)
            raise ScheduleError(
                f"{source} {owner[later][1]}: an action on stage {later}, but no rank holds stage {stage} (no row "
                f"computes it); torch numbers the stages of a pipeline 0..{count - 1}")
    for rank, program in enumerate(programs):
        for action, where in program:
            if action.kind not in _COMMS.values():
                continue
            if action.stage not in owner:
                raise ScheduleError(f"{source} {where}: an action on stage {action.stage}, which no rank holds (no row "
                                    f"computes it; stages are 0..{count - 1})")
            if owner[action.stage][0] != rank:
                raise ScheduleError(f"{source} {where}: stage {action.stage} lives on rank {owner[action.stage][0]}, "
                                    f"so rank {rank} cannot send or receive for it")
    return [owner[stage][0] for stage in range(count)]


def _check_work(programs: Sequence[Sequence[tuple[Action, _Cell]]], placement: Sequence[int], source: str) -> int:
    """The microbatch count (the forwards of stage 0); refuses one out of range, a repeated or a
    missing forward or backward, and a backward before its forward (W: before its I)."""
    first = {action.microbatch for program in programs for whole, _ in program for action in halves(whole)
             if action.kind is Kind.F and action.stage == 0}
    microbatches = len(first)
    if not microbatches:
        raise ScheduleError(f"{source}: stage 0 runs no forward (e.g. 0F0), so the file holds no microbatch")
    done: dict[tuple[Kind, int, int], _Cell] = {}
    for program in programs:
        for whole, where in program:
            for action in halves(whole):
                kind, stage, k = action.kind, action.stage, action.microbatch
                if not 0 <= k < microbatches:
                    raise ScheduleError(
                        f"{source} {where}: microbatch {k} is out of range: stage 0 runs {microbatches} forwards, so "
                        f"microbatches are 0..{microbatches - 1}")
                if kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                    continue
                named = Kind.I if kind is Kind.B else kind  # B counts as the backward I and W make
                if (named, stage, k) in done:
                    raise ScheduleError(f"{source} {where}: stage {stage} already ran this for microbatch {k} at "
                                        f"{done[(named, stage, k)]}")
                if kind is not Kind.F and (Kind.F, stage, k) not in done:
                    raise ScheduleError(f"{source} {where}: the backward of microbatch {k} on stage {stage} comes "
                                        "before its forward")
                if kind is Kind.W and (Kind.I, stage, k) not in done:
                    raise ScheduleError(f"{source} {where}: W of microbatch {k} on stage {stage} comes before its I")
                done[(named, stage, k)] = where
                if kind is Kind.B:
                    done[(Kind.W, stage, k)] = where
    for stage, rank in enumerate(placement):
        for k in range(microbatches):
            forward = done.get((Kind.F, stage, k))
            if forward is None:
                raise ScheduleError(f"{source} row {rank + 1} (rank {rank}): stage {stage} never runs the forward of "
                                    f"microbatch {k}, which stage 0 runs")
            if (Kind.I, stage, k) not in done:
                raise ScheduleError(f"{source} {forward}: the forward of microbatch {k} on stage {stage} has no "
                                    "backward (B, or I and W) in the file")
            if (Kind.W, stage, k) not in done:
                raise ScheduleError(f"{source} {done[(Kind.I, stage, k)]}: the I of microbatch {k} on stage {stage} "
                                    "has no W in the file")
    return microbatches


def _receive_where_needed(program: list[Action]) -> list[Action]:
    """torch's RECV posts a receive (``irecv``) that the compute consuming it waits for; pipetrain's
    marks where the data is needed (an executor may post it earlier): each RECV moves to just
    before its consumer, the F (RECV_F) or the B or I (RECV_B) of its stage and microbatch."""
    waiting: dict[tuple[Kind, int, int], Action] = {}
    out: list[Action] = []
    for action in program:
        if action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
            waiting[(action.kind, action.stage, action.microbatch)] = action
            continue
        for half in halves(action):
            need = Kind.RECV_F if half.kind is Kind.F else Kind.RECV_B if half.kind in (Kind.B, Kind.I) else None
            received = waiting.pop((need, half.stage, half.microbatch), None) if need is not None else None
            if received is not None:
                out.append(received)
        out.append(action)
    out.extend(waiting.values())  # received but never used: the check names them
    return out


def placement_style(placement: Sequence[int], ranks: int) -> str:
    """torch's name of a placement: "loop" (stage s on rank ``s % P``), "v" (a V, two stages a
    rank), or "custom"."""
    if all(rank == stage % ranks for stage, rank in enumerate(placement)):
        return "loop"
    if len(placement) == 2 * ranks and list(placement) == v_placement(ranks):
        return "v"
    return "custom"


def dumps(schedule: Schedule) -> str:
    """torch's compute_only CSV of ``schedule``: one row per rank of its F, I, W, B and pairs
    (``(0F7;7B3)OVERLAP_F_B``), as ``_PipelineScheduleRuntime._load_csv`` reads it."""
    if schedule.is_asynchronous():
        raise ScheduleError(
            f"torch's schedules flush after every step; the {schedule.name} schedule (policy {schedule.policy}) "
            f"does not: write it in pipetrain's format, or choose a flushing schedule")
    if any(len(ranks) != 1 for ranks in schedule.stage_ranks):
        raise ScheduleError(f"torch's CSV places each stage on one rank; drop {option('replicas')}")
    if schedule.steps != 1:
        raise ScheduleError(f"torch's CSV holds one step (torch runs it once per step()); use {option('steps', 1)}")
    handle = io.StringIO()
    writer = csv.writer(handle, lineterminator="\n")
    for program in schedule.programs:
        writer.writerow([_torch_action(action) for action in program
                         if action.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB)])
    return handle.getvalue()


def _torch_action(action: Action) -> str:
    if action.kind is Kind.FB:
        forward, backward = halves(action)
        return f"({_torch_action(forward)};{_torch_action(backward)})OVERLAP_F_B"
    return f"{action.stage}{action.kind.value}{action.microbatch}"


def dump(schedule: Schedule, path: str) -> None:
    """Write :func:`dumps` of ``schedule`` to ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(dumps(schedule))
