"""The schedule IR: actions, per-rank programs, and their text and CSV forms.

A schedule says, for every rank, the ordered list of actions it runs. Everything else in pipetrain
(the timeline simulator, the emulator, the distributed runtime, the planner) consumes this one
representation, so it is small, immutable and printable.

String form of one action (round-trips through :func:`parse_action`)::

    0F3@v1       stage 0, forward of microbatch 3, reading weight version 1
    2B3@v0       stage 2, full backward of microbatch 3 (version 0)
    1I4@v2       stage 1, input-gradient backward of microbatch 4
    1W4@v2       stage 1, weight-gradient backward of microbatch 4
    0SEND_F3>1   stage 0 sends the output of microbatch 3 to rank 1
    1RECV_F3<0   stage 1 receives the input of microbatch 3 from rank 0
    1SEND_B3>0   stage 1 sends the gradient of its input for microbatch 3 to rank 0
    0RECV_B3<1   stage 0 receives the gradient of its output for microbatch 3 from rank 1
    0SYNC        the replicas of stage 0 average their accumulated gradients (all-reduce)
    0STEP        stage 0 applies an optimizer update: a new weight version
    (0F7@v0;3B2@v0)  a pair: the forward of microbatch 7 on stage 0 and the backward of
                 microbatch 2 on stage 3, one action (DualPipe's overlapped F and B; torch
                 writes it ``(0F7;3B2)OVERLAP_F_B``, which parses too)

The version is omitted (``0F3``) before versions are assigned. Microbatch numbers count across
optimizer steps (microbatch ``j`` of step ``t`` is ``t * m + j``), so every (stage, microbatch) pair
names one unit of work.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from pipetrain.errors import ScheduleError

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "COMPUTE",
    "BACKWARD",
    "pair",
    "halves",
    "parse_action",
    "format_action",
    "dumps",
    "loads",
    "dump",
    "load",
]


class Kind(enum.Enum):
    """What an action does."""

    F = "F"  #: forward
    B = "B"  #: full backward (input and weight gradients together)
    I = "I"  #: input-gradient backward (zero-bubble split)  # noqa: E741
    W = "W"  #: weight-gradient backward (zero-bubble split)
    SEND_F = "SEND_F"  #: send this stage's output activations to the next stage
    RECV_F = "RECV_F"  #: receive this stage's input activations from the previous stage
    SEND_B = "SEND_B"  #: send the gradient of this stage's input to the previous stage
    RECV_B = "RECV_B"  #: receive the gradient of this stage's output from the next stage
    SYNC = "SYNC"  #: all-reduce (average) accumulated gradients among the stage's replicas
    STEP = "STEP"  #: optimizer update: the stage's weight version advances by one
    FB = "OVERLAP_F_B"  #: a forward and a backward (B or I) of two microbatches, one action (DualPipe)

    def __repr__(self) -> str:
        return f"Kind.{self.name}"


#: Kinds that run the model and read a weight version (a pair, FB, reads one per half).
COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
#: Kinds that produce the gradient of a stage's input (what SEND_B carries).
BACKWARD = frozenset({Kind.B, Kind.I})

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_SYNC, _STEP, _FB = Kind.SYNC, Kind.STEP, Kind.FB


class Action(NamedTuple):
    """One step of a rank's program.

    ``stage`` is the model stage the action belongs to (for interleaved schedules the virtual
    stage, i.e. the model chunk). ``microbatch`` is ``None`` for SYNC and STEP. ``version`` is the
    weight version F/B/I/W read (``None`` until assigned). ``peer`` is the other rank of a
    SEND/RECV.

    A pair (kind FB, made by :func:`pair`) carries its forward half in ``stage``, ``microbatch``
    and ``version`` and its backward half, a B or I action, in ``peer``; :func:`halves` gives both.
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    version: int | None = None
    peer: "int | Action | None" = None

    def __str__(self) -> str:
        return format_action(self)

    def with_version(self, version: int | None) -> "Action":
        return Action(self.kind, self.stage, self.microbatch, version, self.peer)


def pair(forward: Action, backward: Action) -> Action:
    """One action running ``forward`` (an F) and then ``backward`` (a B or I): DualPipe's paired
    forward and backward, whose compute and communication a GPU overlaps (docs/design.md 2)."""
    if forward.kind is not _F or backward.kind not in BACKWARD:
        raise ScheduleError(
            f"a pair is a forward and then a backward (B or I), e.g. '(0F7;3B2)'; got {format_action(forward)} "
            f"and {format_action(backward)}")
    return Action(_FB, forward.stage, forward.microbatch, forward.version,
                  Action(backward.kind, backward.stage, backward.microbatch, backward.version))


def halves(action: Action) -> tuple[Action, ...]:
    """The compute a rank runs for ``action``: a pair's forward and backward, in that order; any
    other action alone."""
    if action.kind is _FB:
        return (Action(_F, action.stage, action.microbatch, action.version), action.peer)  # type: ignore[return-value]
    return (action,)


def format_action(action: Action) -> str:
    """The short string form of an action (see the module docstring)."""
    kind = action.kind
    if kind is _FB:
        forward, backward = halves(action)
        return f"({format_action(forward)};{format_action(backward)})"
    text = f"{action.stage}{kind.value}"
    if action.microbatch is not None:
        text += str(action.microbatch)
    if action.version is not None:
        text += f"@v{action.version}"
    if action.peer is not None:
        text += (">" if kind is _SEND_F or kind is _SEND_B else "<") + str(action.peer)
    return text


_ACTION_RE = re.compile(
    r"^\s*(?P<stage>\d+)\s*(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|SYNC|STEP|F|B|I|W)"
    r"(?P<mb>\d+)?(?:@v(?P<version>\d+))?(?:(?P<dir>[<>])(?P<peer>\d+))?\s*$"
)
_NEEDS_MICROBATCH = frozenset(Kind) - {_SYNC, _STEP, _FB}
_PAIR_RE = re.compile(r"^\s*\((?P<first>[^;()]*);(?P<second>[^;()]*)\)\s*(?:OVERLAP_F_B)?\s*$")


def parse_action(text: str) -> Action:
    """Parse the short string form, e.g. ``"0F3@v1"``, ``"1RECV_F3<0"`` or ``"(0F7;3B2)"``."""
    paired = _PAIR_RE.match(text)
    if paired is not None:
        halves_ = [parse_action(paired[name]) for name in ("first", "second")]
        if halves_[0].kind is not _F or halves_[1].kind not in BACKWARD:
            raise ScheduleError(
                f"action {text!r}: a pair is a forward and then a backward (B or I), e.g. '(0F7;3B2)'")
        return pair(*halves_)
    match = _ACTION_RE.match(text)
    if match is None:
        raise ScheduleError(
            f"cannot parse action {text!r}: expected STAGE KIND [MICROBATCH] [@vVERSION] [>PEER|<PEER], "
            "for example '0F3@v1', '1B3', '0SEND_F3>1', '1RECV_F3<0', '0SYNC', '0STEP' or the pair '(0F7;3B2)'"
        )
    kind = Kind(match["kind"])
    microbatch = int(match["mb"]) if match["mb"] is not None else None
    if kind in _NEEDS_MICROBATCH and microbatch is None:
        raise ScheduleError(f"action {text!r}: {kind.value} needs a microbatch number, e.g. '0{kind.value}3'")
    if kind not in _NEEDS_MICROBATCH and microbatch is not None:
        raise ScheduleError(f"action {text!r}: {kind.value} takes no microbatch number (write '0{kind.value}')")
    version = int(match["version"]) if match["version"] is not None else None
    if version is not None and kind not in COMPUTE:
        raise ScheduleError(f"action {text!r}: only F, B, I and W read a weight version")
    peer = int(match["peer"]) if match["peer"] is not None else None
    if peer is not None:
        expected = ">" if kind in (_SEND_F, _SEND_B) else "<" if kind in (_RECV_F, _RECV_B) else None
        if expected is None:
            raise ScheduleError(f"action {text!r}: only SEND and RECV name a peer rank")
        if match["dir"] != expected:
            raise ScheduleError(f"action {text!r}: write the peer of {kind.value} as '{expected}RANK'")
    return Action(kind, int(match["stage"]), microbatch, version, peer)


@dataclass
class Schedule:
    """A whole schedule: one program per rank, and where each stage lives.

    Attributes:
        programs: ``programs[rank]`` is the ordered list of actions of that rank.
        stage_ranks: ``stage_ranks[stage]`` lists the ranks holding the stage's replicas; microbatch
            ``k`` of stage ``s`` runs on replica ``k % len(stage_ranks[s])`` (1F1B-RR routing).
        name: the preset that generated it (``"custom"`` for a hand-written one).
        policy: the weight-version policy (``flush``, ``stash``, ``vsync``, ``2bw``, ``latest``,
            ``predict``): how versions were assigned, and for ``predict`` that forwards read
            predicted weights.
        microbatches: microbatches per optimizer step (per flush); for asynchronous schedules
            (pipedream, pb) the number of pipeline units in total, each its own update.
        steps: optimizer steps the schedule covers (1 for asynchronous schedules).
        chunks: model chunks per rank (interleaved schedules; 2 for the V schedules), else 1.
    """

    programs: list[list[Action]]
    stage_ranks: list[list[int]]
    name: str = "custom"
    policy: str = "flush"
    microbatches: int = 0
    steps: int = 1
    chunks: int = 1
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.programs)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def total_microbatches(self) -> int:
        """Distinct microbatch numbers the schedule runs (across all steps)."""
        return self.microbatches * self.steps

    @property
    def replicas(self) -> list[int]:
        return [len(ranks) for ranks in self.stage_ranks]

    def rank_stages(self) -> list[list[int]]:
        """``rank_stages()[rank]``: the stages (chunks) that rank holds, in increasing order."""
        held: list[list[int]] = [[] for _ in self.programs]
        for stage, ranks in enumerate(self.stage_ranks):
            for rank in ranks:
                held[rank].append(stage)
        return held

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` on ``stage`` (replica ``microbatch % replicas``)."""
        ranks = self.stage_ranks[stage]
        return ranks[microbatch % len(ranks)]

    def peer_of(self, action: Action) -> int:
        """The rank a SEND goes to or a RECV comes from: the action's own ``peer`` if it names
        one, else the rank that runs the microbatch on the neighbouring stage."""
        if action.peer is not None:
            return action.peer
        kind = action.kind
        other = action.stage + 1 if kind is Kind.SEND_F or kind is Kind.RECV_B else action.stage - 1
        return self.rank_of(other, action.microbatch)

    def replica_of(self, rank: int, stage: int) -> int:
        return self.stage_ranks[stage].index(rank)

    def is_asynchronous(self) -> bool:
        return self.policy not in ("flush",)

    def __str__(self) -> str:
        return dumps(self)


# ---------------------------------------------------------------------------------------------
# Text / CSV form
#
#   # pipetrain schedule
#   # name=1f1b policy=flush microbatches=4 steps=1 chunks=1 placement=0;1
#   0,0F0@v0,0SEND_F0>1,0F1@v0,...
#   1,1RECV_F0<0,1F0@v0,...
#
# One line per rank: the rank number, then its actions, comma-separated. ``placement`` lists the
# ranks of each stage (``0|2;1`` = stage 0 on ranks 0 and 2, stage 1 on rank 1). Every header
# field is optional: placement is inferred from the actions when absent.
# ---------------------------------------------------------------------------------------------

_HEADER = "# pipetrain schedule"


def dumps(schedule: Schedule) -> str:
    """The text (CSV) form of a schedule; :func:`loads` reads it back unchanged."""
    placement = ";".join("|".join(str(r) for r in ranks) for ranks in schedule.stage_ranks)
    fields = {
        "name": schedule.name,
        "policy": schedule.policy,
        "microbatches": str(schedule.microbatches),
        "steps": str(schedule.steps),
        "chunks": str(schedule.chunks),
        "placement": placement,
        **schedule.meta,
    }
    lines = [_HEADER, "# " + " ".join(f"{k}={v}" for k, v in fields.items())]
    for rank, program in enumerate(schedule.programs):
        lines.append(",".join([str(rank), *(format_action(a) for a in program)]))
    return "\n".join(lines) + "\n"


def loads(text: str) -> Schedule:
    """Read the text (CSV) form written by :func:`dumps` or by hand."""
    fields: dict[str, str] = {}
    rows: dict[int, list[Action]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            for token in line[1:].split():
                if "=" in token:
                    key, _, value = token.partition("=")
                    fields[key] = value
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            rank = int(cells[0])
        except ValueError:
            raise ScheduleError(
                f"line {lineno}: a program line starts with its rank number, e.g. '0,0F0,0F1,...'; got {cells[0]!r}"
            ) from None
        if rank in rows:
            raise ScheduleError(f"line {lineno}: rank {rank} has two program lines")
        actions = []
        for column, cell in enumerate(cells[1:], start=2):
            if not cell:
                continue
            try:
                actions.append(parse_action(cell))
            except ScheduleError as error:
                raise ScheduleError(f"line {lineno}, cell {column}: {error}") from None
        rows[rank] = actions
    if not rows:
        raise ScheduleError("the schedule has no program lines ('RANK,ACTION,ACTION,...')")
    num_ranks = max(rows) + 1
    missing = [r for r in range(num_ranks) if r not in rows]
    if missing:
        raise ScheduleError(f"ranks {missing} have no program line; ranks must be numbered 0..{num_ranks - 1}")
    programs = [rows[r] for r in range(num_ranks)]
    stage_ranks = _parse_placement(fields.get("placement"), programs)
    try:
        microbatches = int(fields.get("microbatches", 0))
        steps = int(fields.get("steps", 1))
        chunks = int(fields.get("chunks", 1))
    except ValueError as error:
        raise ScheduleError(f"bad number in the schedule header: {error}") from None
    if microbatches <= 0:
        mbs = {h.microbatch for p in programs for a in p for h in halves(a) if h.microbatch is not None}
        microbatches = (max(mbs) + 1) if mbs else 0
        steps = 1
    known = {"name", "policy", "microbatches", "steps", "chunks", "placement"}
    return Schedule(
        programs=programs,
        stage_ranks=stage_ranks,
        name=fields.get("name", "custom"),
        policy=fields.get("policy", "flush"),
        microbatches=microbatches,
        steps=steps,
        chunks=chunks,
        meta={k: v for k, v in fields.items() if k not in known},
    )


def _parse_placement(text: str | None, programs: Sequence[Sequence[Action]]) -> list[list[int]]:
    if text:
        try:
            return [[int(r) for r in part.split("|")] for part in text.split(";")]
        except ValueError:
            raise ScheduleError(
                f"bad placement {text!r}: write the ranks of each stage separated by ';', replicas by '|', e.g. '0|2;1'"
            ) from None
    found: dict[int, set[int]] = {}
    for rank, program in enumerate(programs):
        for action in program:
            for half in halves(action):
                found.setdefault(half.stage, set()).add(rank)
    if not found:
        return []
    num_stages = max(found) + 1
    missing = [s for s in range(num_stages) if s not in found]
    if missing:
        raise ScheduleError(f"stages {missing} appear in no program; stages must be numbered 0..{num_stages - 1}")
    return [sorted(found[s]) for s in range(num_stages)]


def dump(schedule: Schedule, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(dumps(schedule))


def load(path: str) -> Schedule:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ScheduleError(f"cannot read schedule file {path!r}: {error.strerror}") from None
    return loads(text)
