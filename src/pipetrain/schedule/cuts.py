"""Consistent cuts of a schedule: where each rank stops to checkpoint after the first c units.

Rank r's cut for unit count c lies right after the action that finishes the backward (B, or W
when split) of its last microbatch below c, together with the SYNC and STEP that immediately
follow. Asynchronous schedules never flush, so at a cut some microbatches are still in flight
(forward done, backward not) and some messages have been sent but not yet received. A cut is
*consistent* when nothing a rank receives before its cut was sent after the sender's cut; then
resuming is exact if every rank replays the forwards of its in-flight microbatches from their
saved inputs and re-sends the messages that crossed the cut.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Sequence

from pipetrain.errors import ConfigError, option
from pipetrain.schedule.ir import Kind, Schedule, halves
from pipetrain.schedule.messages import Messages
from pipetrain.schedule.pattern import PeriodicProgram, pattern_of

__all__ = ["Cut", "cut", "cuts", "feed_cuts", "shared_updates", "split_counts", "in_flight"]


@dataclass
class Cut:
    """Per rank: the program position to resume at, and what crossed the cut."""

    units: int
    positions: list[int]
    #: per rank, positions of its SEND actions (before its cut) whose receive is after the peer's cut
    crossing_sends: list[list[int]] = field(default_factory=list)

    def shifted(self, pattern: Any, periods: int) -> "Cut":
        """The same cut ``periods`` periods of a long schedule's ``pattern`` later (earlier when
        negative): between its sample and the long schedule."""
        lengths = [program._l for program in pattern.programs]
        return Cut(self.units + periods * pattern.units,
                   [p + periods * lengths[r] for r, p in enumerate(self.positions)],
                   [[p + periods * lengths[r] for p in sends] for r, sends in enumerate(self.crossing_sends)])


def shared_updates(schedule: Schedule) -> list[tuple[int, int, int]]:
    """The updates that replicas of a stage make together: ``(stage, first, last)`` units.

    The replicas of a stage sum their gradients at each SYNC, each over the microbatches it ran
    since the previous one. No rank can stop after ``c`` units while such an update holds units
    on both sides of ``c`` (``first < c <= last``): one replica would wait at the SYNC for a
    backward that another runs only after its own stop.
    """
    groups: dict[tuple[int, int], list[int]] = {}  # (stage, SYNC occurrence) -> its units
    for program in schedule.programs:
        pending: dict[int, list[int]] = {}
        seen: dict[int, int] = {}
        for action in (half for whole in program for half in halves(whole)):
            stage = action.stage
            if len(schedule.stage_ranks[stage]) < 2:
                continue
            if action.kind in (Kind.B, Kind.W):
                pending.setdefault(stage, []).append(action.microbatch)
            elif action.kind is Kind.SYNC:
                occurrence = seen.get(stage, 0)
                seen[stage] = occurrence + 1
                groups.setdefault((stage, occurrence), []).extend(pending.pop(stage, []))
    return [(stage, min(units), max(units)) for (stage, _), units in sorted(groups.items()) if units]


class _SplitCounts:
    """``count in split``: whether stopping after ``count`` units would split an update that the
    replicas of a stage make together (of a long schedule: at the same place of its sample)."""

    def __init__(self, schedule: Schedule) -> None:
        self.pattern = pattern_of(schedule)
        self.split = {c for _, first, last in shared_updates(schedule if self.pattern is None else self.pattern.sample)
                      for c in range(first + 1, last + 1)}

    def __contains__(self, count: object) -> bool:
        if self.pattern is not None and isinstance(count, int):
            count -= self.pattern.shift_of_units(count) * self.pattern.units
        return count in self.split


def split_counts(schedule: Schedule) -> _SplitCounts:
    """The unit counts after which no rank can stop (see :func:`shared_updates`), as a set-like
    object that a long schedule answers from its pattern."""
    return _SplitCounts(schedule)


def cut(schedule: Schedule, units: int, messages: Messages | None = None) -> Cut:
    """The cut after ``units`` units, or a ConfigError if it is not consistent or leaves a split
    backward half done. ``messages``: the schedule's :class:`~pipetrain.schedule.messages.Messages`,
    if already built."""
    pattern = pattern_of(schedule)
    if pattern is not None:
        return cuts(schedule, [units], messages)[0]
    for stage, first, last in shared_updates(schedule):
        if first < units <= last:
            raise ConfigError(
                f"cannot stop after {units} units: the replicas of stage {stage} update together over units "
                f"{first}..{last}; choose another {option('checkpoint_every')} or {option('eval_every')}"
            )
    positions = [_positions(program, [units])[0] for program in schedule.programs]
    messages = Messages(schedule) if messages is None else messages
    crossing_sends: list[list[int]] = [[] for _ in schedule.programs]
    for rank, program in enumerate(schedule.programs):
        inputs_done: set[tuple[int, int]] = set()
        for position, action in _halves_at(program):
            kind, stage, k = action.kind, action.stage, action.microbatch
            before = position < positions[rank]
            if kind is Kind.I and before:
                inputs_done.add((stage, k))
            elif kind is Kind.W and before:
                inputs_done.discard((stage, k))
            elif kind in (Kind.SEND_F, Kind.SEND_B):
                peer, received = messages.received_at[Messages.of(action)]
                if before and received >= positions[peer]:
                    if kind is Kind.SEND_B:
                        raise ConfigError(
                            f"cannot checkpoint after {units} units: the gradient of microbatch {k} sent by rank {rank} "
                            f"would still be in flight; choose another {option('checkpoint_every')}"
                        )
                    crossing_sends[rank].append(position)
                elif not before and received < positions[peer]:
                    raise ConfigError(
                        f"cannot checkpoint after {units} units: rank {peer} receives {kind.value} of microbatch {k} "
                        f"before its cut, but rank {rank} sends it after its own; choose another {option('checkpoint_every')}"
                    )
        if inputs_done:
            raise ConfigError(
                f"cannot checkpoint after {units} units: rank {rank} has run the I but not the W of "
                f"{sorted(inputs_done)}; choose a {option('checkpoint_every')} that ends on a step"
            )
    return Cut(units, positions, crossing_sends)


def cuts(schedule: Schedule, counts: Sequence[int], messages: Messages | None = None) -> list[Cut]:
    """:func:`cut` for many unit counts at once, in one pass over the programs and messages
    (evaluating or checkpointing after every update would otherwise scan the programs once per
    update). Raises :func:`cut`'s error for the smallest count that has one."""
    pattern = pattern_of(schedule)
    if pattern is not None:  # each cut is the sample's at the same place of its middle periods, shifted
        shifts = [pattern.shift_of_units(units) for units in counts]
        sample_messages = pattern.cached("messages", lambda: Messages(pattern.sample))
        found = cuts(pattern.sample, [units - s * pattern.units for units, s in zip(counts, shifts)], sample_messages)
        return [c.shifted(pattern, s) for s, c in zip(shifts, found)]
    order = sorted(set(counts))
    if not order:
        return []
    messages = Messages(schedule) if messages is None else messages
    positions = [_positions(program, order) for program in schedule.programs]  # rank -> per count
    bad = len(order)  # index of the smallest count that cannot be cut

    def refuse(start: int, stop: int) -> None:
        nonlocal bad
        if start < stop:
            bad = min(bad, start)

    crossing: list[list[list[int]]] = [[[] for _ in schedule.programs] for _ in order]
    for rank, program in enumerate(schedule.programs):
        inputs: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> position of its I
        for position, action in enumerate(program):
            kind = action.kind
            if kind is Kind.I:
                inputs[(action.stage, action.microbatch)] = position
            elif kind is Kind.W and (action.stage, action.microbatch) in inputs:
                # an I before the cut and its W after it
                start = inputs.pop((action.stage, action.microbatch))
                refuse(bisect_right(positions[rank], start), bisect_right(positions[rank], position))
            elif kind is Kind.SEND_F or kind is Kind.SEND_B:
                peer, received = messages.received_at[Messages.of(action)]
                sent_before = bisect_right(positions[rank], position)  # cuts from here on hold the send
                taken_before = bisect_right(positions[peer], received)  # cuts before here miss the receive
                refuse(taken_before, sent_before)  # received before the cut, sent after it
                if kind is Kind.SEND_B:
                    refuse(sent_before, taken_before)  # a gradient in flight
                for index in range(sent_before, taken_before):
                    crossing[index][rank].append(position)
    for _, first, last in shared_updates(schedule):
        refuse(bisect_right(order, first), bisect_right(order, last))
    if bad < len(order):
        cut(schedule, order[bad], messages)  # raises the error that names what is wrong
        raise AssertionError(f"no error found for {order[bad]} units")  # pragma: no cover
    found = {
        units: Cut(units, [positions[rank][index] for rank in range(schedule.num_ranks)], crossing[index])
        for index, units in enumerate(order)
    }
    return [found[units] for units in counts]


def feed_cuts(schedule: Schedule, units_per_update: int, messages: Messages | None = None) -> list[list[int]]:
    """Where every rank stands once the batches of updates ``0..t`` have been fed, for each update
    ``t``: as far into its program as it can go without the batch of update ``t + 1``.

    A training loop that hands pipetrain one batch at a time runs each rank up to these
    positions per call, so asynchronous schedules stay full across calls (nothing waits for a
    flush) and a call never blocks on work that only a later call can do. A dry run of all
    programs: a forward of stage 0 needs its batch fed, a receive its send, a SYNC every replica.
    Each piece is a consistent cut (everything received before it was sent before it), and the
    last one is the end of every program.

    For a long schedule expanded from a pattern: a sequence that computes each update's piece from
    its sample's (:class:`FeedCuts`), instead of a list of them all.
    """
    pattern = pattern_of(schedule)
    if pattern is not None and pattern.units % units_per_update == 0:
        return FeedCuts(pattern, feed_cuts(pattern.sample, units_per_update), units_per_update,
                        -(-schedule.total_microbatches // units_per_update))  # type: ignore[return-value]
    programs = schedule.programs
    messages = Messages(schedule) if messages is None else messages
    units = max((h.microbatch + 1 for p in programs for a in p for h in halves(a) if h.kind is Kind.F and h.stage == 0),
                default=0)
    updates = -(-units // units_per_update)
    pcs = [0] * len(programs)
    sync_count: dict[tuple[int, int], int] = {}  # (rank, stage) -> SYNCs passed
    sync_arrived: dict[tuple[int, int], set[int]] = {}  # (stage, occurrence) -> ranks arrived
    out: list[list[int]] = []
    for update in range(updates):
        fed = (update + 1) * units_per_update
        progress = True
        while progress:
            progress = False
            for rank, program in enumerate(programs):
                pc = pcs[rank]
                while pc < len(program):
                    action = program[pc]
                    kind = action.kind
                    if kind is Kind.F and action.stage == 0 and action.microbatch >= fed:
                        break
                    if kind is Kind.FB and action.stage == 0 and action.microbatch >= fed:  # a pair's forward
                        break
                    if kind is Kind.RECV_F or kind is Kind.RECV_B:
                        sender, position = messages.sent_at[Messages.of(action)]
                        if pcs[sender] <= position:
                            break
                    elif kind is Kind.SYNC and len(schedule.stage_ranks[action.stage]) > 1:
                        occurrence = (action.stage, sync_count.get((rank, action.stage), 0))
                        arrived = sync_arrived.setdefault(occurrence, set())
                        arrived.add(rank)
                        if len(arrived) < len(schedule.stage_ranks[action.stage]):
                            break
                        sync_count[(rank, action.stage)] = occurrence[1] + 1
                    pc += 1
                if pc != pcs[rank]:
                    pcs[rank] = pc
                    progress = True
        out.append(list(pcs))
    if out and any(pc != len(p) for pc, p in zip(out[-1], programs)):
        stuck = [rank for rank, (pc, p) in enumerate(zip(out[-1], programs)) if pc != len(p)]
        raise ConfigError(f"the programs of ranks {stuck} cannot run to their end (see `pipetrain schedule --load`)")
    return out


class FeedCuts(Sequence):
    """:func:`feed_cuts` of a long schedule: piece ``t`` is the sample's piece at the same place of
    its middle periods, shifted. Slices are views (``pieces[:-1]``), never lists of every piece."""

    def __init__(self, pattern, sample: list[list[int]], units_per_update: int, updates: int,
                 start: int = 0, stop: int | None = None) -> None:
        self.pattern, self.sample, self.per, self.updates = pattern, sample, units_per_update, updates
        self.start, self.stop = start, updates if stop is None else stop
        self._lengths = [program._l for program in pattern.programs]

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return FeedCuts(self.pattern, self.sample, self.per, self.updates, self.start + start,
                            self.start + max(start, stop))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("update out of range")
        update = self.start + index
        shift = self.pattern.shift_of_units((update + 1) * self.per)
        piece = self.sample[update - shift * (self.pattern.units // self.per)]
        return [p + shift * length for p, length in zip(piece, self._lengths)]


def in_flight(program: Sequence, positions: Sequence[int]) -> list[list]:
    """For each of one rank's cut ``positions``: its forwards in flight there (F actions before the
    cut whose backward is at or after it), in program order.

    A resumed run replays them, so the checkpoint holds their inputs and the versions they read.
    Under the ``latest`` policy (Pipelined Backpropagation) a forward's version is released as soon
    as the forward is done, since the backward reads the current weights; a rank that checkpoints
    keeps such versions up to the cut (:meth:`~pipetrain.runtime.rank_runner.RankRunner.keep_for_cuts`).
    """
    if isinstance(program, PeriodicProgram) and program.pattern is not None:  # the sample's, shifted
        pattern, rank = program.pattern, program.rank
        mapped = [pattern.to_sample(rank, position) for position in positions]
        found = in_flight(pattern.sample.programs[rank], [q for q, _ in mapped])
        return [[program.shift(action, shift) for action in actions] for (_, shift), actions in zip(mapped, found)]
    forwards: dict[tuple[int, int], tuple[int, object]] = {}  # (stage, microbatch) -> (position, F)
    ends: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> position of its last backward action
    for position, action in _halves_at(program):
        kind = action.kind
        if kind is Kind.F:
            forwards[(action.stage, action.microbatch)] = (position, action)
        elif kind is Kind.B or kind is Kind.W:
            ends[(action.stage, action.microbatch)] = position
    return [
        [action for key, (start, action) in forwards.items() if start < cut <= ends.get(key, cut)]
        for cut in positions
    ]


def _positions(program: Sequence, order: Sequence[int]) -> list[int]:
    """Where one rank's cut lies for each count of ``order`` (ascending): right after the action
    that finishes the backward of its last microbatch below the count, with the SEND_B, SYNC and
    STEP that follow it."""
    backwards = sorted(
        (action.microbatch, position)
        for position, action in _halves_at(program)
        if action.microbatch is not None and action.kind in (Kind.B, Kind.W)
    )
    after = list(range(len(program) + 1))  # position -> first position at or after it that is not tied to a backward
    for position in range(len(program) - 1, -1, -1):
        if program[position].kind in (Kind.SEND_B, Kind.SYNC, Kind.STEP):
            after[position] = after[position + 1]
    out, last, index = [], -1, 0
    for units in order:
        while index < len(backwards) and backwards[index][0] < units:
            last = max(last, backwards[index][1])
            index += 1
        out.append(after[last + 1])
    return out


def _halves_at(program: Sequence):
    """``(position, action)`` of a program, a pair's forward and backward both at its position."""
    for position, action in enumerate(program):
        if action.kind is Kind.FB:
            for half in halves(action):
                yield position, half
        else:
            yield position, action
