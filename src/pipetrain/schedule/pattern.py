"""Long schedules as a steady-state pattern: programs expanded a period at a time, never stored whole.

Every named schedule is periodic in its units: after its warm-up, each rank repeats the same
actions with microbatch numbers advanced by a period of ``P`` units and weight versions by the
updates that period makes. :func:`periodic` builds the schedule three times with ``k``, ``k + 1`` and
``k + 2`` periods (small), finds each rank's program as ::

    head + body, body shifted once, ..., body shifted m - 1 times + tail shifted m times

from the first two, checks that this rule reproduces the third exactly, and returns the schedule of
``k + m`` periods whose programs are :class:`PeriodicProgram` sequences: an action is computed when
asked for (``program[i]``), so a run of 100,000 steps holds the pattern, not 500,000 actions.

The built schedule of ``k`` periods is the pattern's *sample*. Whatever depends on the program
near a position (where a message is sent and received, when a version is released, where a cut
lies, which forwards are in flight) is read off the sample at the corresponding position of its
middle periods and shifted: the long program equals the sample shifted by ``s`` periods from
``h + s * L`` on, for every ``s`` up to ``m`` (``h`` the head, ``L`` the body length). Validation
checks the sample of ``k + 2`` periods: the head, bodies meeting bodies and the tail, i.e. the
pattern and all its seams.
"""

from __future__ import annotations

import os
from math import lcm
from typing import Callable, Iterator, Sequence, overload

from pipetrain.schedule.ir import Action, Kind, Schedule

__all__ = ["PeriodicProgram", "Pattern", "periodic", "pattern_of", "period_units", "MIN_COPIES", "min_copies"]

#: Periods of the sample (the built schedule the pattern is read from and checked on); the middle
#: ones are at least two periods away from the head and the tail.
SAMPLE_COPIES = 5
#: Runs of fewer periods than this are built whole (cheaper than the three samples); the
#: environment variable PIPETRAIN_PATTERN_MIN_COPIES overrides it (a testing aid: a small value
#: runs short schedules from their pattern, a huge one builds every schedule whole).
MIN_COPIES = 16


def min_copies() -> int:
    """The periods from which a schedule is run from its pattern (see :data:`MIN_COPIES`)."""
    value = os.environ.get("PIPETRAIN_PATTERN_MIN_COPIES")
    return int(value) if value else MIN_COPIES


_new = tuple.__new__
_FB = Kind.FB


class PeriodicProgram(Sequence[Action]):
    """One rank's program of a long schedule: ``head``, ``copies`` shifted ``body`` copies, ``tail``.

    Copy ``j`` of the body and the tail (after ``copies`` copies) have their microbatch numbers
    advanced by ``j * units`` and the versions of stage ``s`` by ``j * versions[s]``.
    """

    def __init__(self, head: Sequence[Action], body: Sequence[Action], copies: int, tail: Sequence[Action],
                 units: int, versions: dict[int, int], pattern: "Pattern | None" = None, rank: int = 0) -> None:
        self.head, self.body, self.tail = tuple(head), tuple(body), tuple(tail)
        self.copies, self.units, self.versions = copies, units, dict(versions)
        self.pattern, self.rank = pattern, rank
        self._h, self._l = len(self.head), len(self.body)
        self._body_length = copies * self._l
        self._length = self._h + self._body_length + len(self.tail)
        self._copy, self._expanded = 0, list(self.body)  # the body copy last read, expanded

    def __len__(self) -> int:
        return self._length

    def shift(self, action: Action, periods: int) -> Action:
        """``action`` moved ``periods`` periods on: microbatch and version advanced."""
        if not periods:
            return action
        kind, stage, k, version, peer = action
        if kind is _FB:  # a pair: both halves move
            peer = self.shift(peer, periods)
        if k is not None:
            k += periods * self.units
        if version is not None:
            version += periods * self.versions.get(stage, 0)
        return _new(Action, (kind, stage, k, version, peer))

    def _expand(self, copy: int) -> list[Action]:
        """Body copy ``copy``, every action shifted."""
        units = copy * self.units
        versions = {stage: copy * count for stage, count in self.versions.items()}
        return [_new(Action, (kind, stage, None if k is None else k + units,
                              None if version is None else version + versions.get(stage, 0), peer))
                if kind is not _FB else self.shift(_new(Action, (kind, stage, k, version, peer)), copy)
                for kind, stage, k, version, peer in self.body]

    def _at(self, index: int) -> Action:
        rest = index - self._h
        if rest < 0:
            return self.head[rest]
        if rest < self._body_length:
            copy, offset = divmod(rest, self._l)
            if copy != self._copy:  # a rank reads its program in order: expand one copy at a time
                self._expanded = self._expand(copy)
                self._copy = copy
            return self._expanded[offset]
        return self.shift(self.tail[rest - self._body_length], self.copies)

    @overload
    def __getitem__(self, index: int) -> Action: ...

    @overload
    def __getitem__(self, index: slice) -> list[Action]: ...

    def __getitem__(self, index):
        if index.__class__ is int and 0 <= index < self._length:
            return self._at(index)
        if isinstance(index, slice):
            return [self._at(i) for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("program position out of range")
        return self._at(index)

    def __iter__(self) -> Iterator[Action]:
        yield from self.head
        for copy in range(self.copies):
            yield from self.body if copy == 0 else self._expand(copy)
        shift, copies = self.shift, self.copies
        for action in self.tail:
            yield shift(action, copies)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, PeriodicProgram)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"PeriodicProgram(head={self._h}, body={self._l} x {self.copies}, tail={len(self.tail)}, "
                f"{self.units} units per period)")

    def count_where(self, predicate: Callable[[Action], bool]) -> int:
        """How many actions satisfy ``predicate`` (whose answer must not depend on the shift,
        e.g. on the kind and the stage), without expanding the program."""
        return (sum(1 for a in self.head if predicate(a)) + self.copies * sum(1 for a in self.body if predicate(a))
                + sum(1 for a in self.tail if predicate(a)))


class Pattern:
    """The steady-state pattern of a long schedule and the sample it was read from.

    ``sample``: the built schedule of ``SAMPLE_COPIES`` periods; ``copies``: the periods the long
    schedule has beyond the sample's (``m``); ``units``: units per period; ``programs``: the long
    schedule's :class:`PeriodicProgram` per rank.
    """

    def __init__(self, sample: Schedule, check_sample: Schedule, programs: list[PeriodicProgram], units: int,
                 copies: int) -> None:
        self.sample, self.check_sample, self.programs = sample, check_sample, programs
        self.units, self.copies = units, copies
        self.mid = SAMPLE_COPIES // 2
        #: what analyses computed on the sample once (its messages, release points, ...), by name
        self.cache: dict = {}

    def cached(self, key, compute: Callable[[], object]):
        """``compute()`` once per pattern and ``key``."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def shift_of_units(self, units: int) -> int:
        """Periods to shift the sample by so that a unit count (or unit number) ``units`` of the
        long schedule falls in the sample's middle periods."""
        return max(0, min(units // self.units - self.mid, self.copies))

    def shift_of_position(self, rank: int, position: int) -> int:
        """Periods to shift the sample by so that ``position`` of ``rank``'s long program falls in
        the sample's middle periods."""
        program = self.programs[rank]
        if program._l == 0:
            return 0
        copy = (position - program._h) // program._l
        return max(0, min(copy - self.mid, self.copies))

    def to_sample(self, rank: int, position: int) -> tuple[int, int]:
        """``(sample position, shift)``: the long program's ``position`` is the sample's shifted."""
        shift = self.shift_of_position(rank, position)
        return position - shift * self.programs[rank]._l, shift

    def lag(self, rank: int) -> int:
        """Positions of ``rank``'s program within which a unit's actions (and a version's reads
        and release) lie: a period's body and the head and tail around it."""
        program = self.programs[rank]
        return 3 * program._l + program._h + len(program.tail)


class ShiftedEnds:
    """``message -> (rank, position)`` of a long schedule, read off the sample's table (see
    :class:`~pipetrain.schedule.messages.Messages`)."""

    def __init__(self, pattern: Pattern, sample: dict) -> None:
        self.pattern, self.sample = pattern, sample
        self._lengths = [p._l for p in pattern.programs]

    def __getitem__(self, message: tuple) -> tuple[int, int]:
        kind, stage, k = message
        pattern = self.pattern
        shift = pattern.shift_of_units(k)
        rank, position = self.sample[(kind, stage, k - shift * pattern.units)]
        return rank, position + shift * self._lengths[rank]

    def get(self, message: tuple, default=None):
        try:
            return self[message]
        except KeyError:
            return default

    def __contains__(self, message: object) -> bool:
        return self.get(message) is not None  # type: ignore[arg-type]


class ShiftedReleases:
    """Position -> ``[(stage, version)]`` released there in one rank's long program (see
    :func:`~pipetrain.execution.version_store.version_release_points`), read off the sample's, with
    the changes a rank makes to keep versions for its checkpoints on top."""

    def __init__(self, program: PeriodicProgram, sample: dict[int, list[tuple[int, int]]]) -> None:
        assert program.pattern is not None
        self.program, self.pattern, self.sample = program, program.pattern, sample
        self.changed: dict[int, list[tuple[int, int]]] = {}
        # the steady middle, by offset in the body: the sample's releases of its middle copy
        h, length, mid = program._h, program._l, self.pattern.mid
        self._middle = [sample.get(h + mid * length + offset) for offset in range(length)]
        self._first, self._last = mid, mid + self.pattern.copies  # copies read off the middle one

    def get(self, position: int, default=None):
        if self.changed:
            changed = self.changed.get(position)
            if changed is not None:
                return changed
        program = self.program
        if program._l:
            copy, offset = divmod(position - program._h, program._l)
            if self._first <= copy <= self._last:
                found = self._middle[offset]
                if found is None:
                    return default
                shift = copy - self._first
                if not shift:
                    return found
                versions = program.versions
                return [(stage, version + shift * versions.get(stage, 0)) for stage, version in found]
        sample_position, shift = self.pattern.to_sample(self.program.rank, position)
        found = self.sample.get(sample_position)
        if found is None:
            return default
        if not shift:
            return found
        versions = self.program.versions
        return [(stage, version + shift * versions.get(stage, 0)) for stage, version in found]

    def __getitem__(self, position: int) -> list[tuple[int, int]]:
        found = self.get(position)
        if found is None:
            raise KeyError(position)
        return found

    def __setitem__(self, position: int, keys: list[tuple[int, int]]) -> None:
        self.changed[position] = keys

    def setdefault(self, position: int, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
        found = self.changed.get(position)
        if found is None:
            found = self.changed[position] = list(self.get(position, default))
        return found

    def released_before(self, key: tuple[int, int], position: int) -> int | None:
        """Where ``key`` is released if that is before ``position`` and within a period's reach
        of it (the reads of a version in flight at ``position`` are), else None."""
        rank = self.program.rank
        for at in range(position - 1, max(-1, position - 1 - self.pattern.lag(rank)), -1):
            found = self.get(at)
            if found and key in found:
                return at
        return None


def pattern_of(schedule: Schedule) -> Pattern | None:
    """The pattern whose expansion ``schedule``'s programs are (None for a schedule stored whole)."""
    programs = schedule.programs
    if not programs or not isinstance(programs[0], PeriodicProgram):
        return None
    pattern = programs[0].pattern
    if pattern is None or len(pattern.programs) != len(programs):
        return None
    if any(a is not b for a, b in zip(programs, pattern.programs)):
        return None
    return pattern


def periodic(make: Callable[[int], Schedule], copies: int, units: int, microbatches: int,
             steps: int) -> Schedule | None:
    """The schedule of ``copies`` periods of ``units`` units, as a pattern; ``make(n)`` builds the
    whole schedule of ``n`` periods; ``microbatches`` and ``steps`` are the long schedule's (see
    :class:`~pipetrain.schedule.ir.Schedule`). None when the run is too short to be worth it or the
    schedule does not repeat (the caller builds it whole then)."""
    if copies < max(min_copies(), SAMPLE_COPIES + 2):
        return None
    base = SAMPLE_COPIES
    first, second, third = make(base), make(base + 1), make(base + 2)
    extra = copies - base
    programs: list[PeriodicProgram] = []
    for rank, (a, b, c) in enumerate(zip(first.programs, second.programs, third.programs)):
        program = _fit(a, b, units, rank)
        if program is None:
            return None
        trial = PeriodicProgram(program.head, program.body, 2, program.tail, units, program.versions)
        if len(trial) != len(c) or any(x != y for x, y in zip(trial, c)):
            return None
        programs.append(PeriodicProgram(program.head, program.body, extra, program.tail, units, program.versions,
                                        rank=rank))
    pattern = Pattern(first, third, programs, units, extra)
    for program in programs:
        program.pattern = pattern
    return Schedule(programs, [list(r) for r in first.stage_ranks], name=first.name, policy=first.policy,
                    microbatches=microbatches, steps=steps, chunks=first.chunks, meta=dict(first.meta))


def _fit(a: Sequence[Action], b: Sequence[Action], units: int, rank: int) -> PeriodicProgram | None:
    """Head, body and tail such that ``b`` is ``a`` with one more body copy (``None`` if none)."""
    length = len(b) - len(a)
    if length <= 0:
        return None
    versions: dict[int, int] = {}
    # the body's version shift per stage: the STEPs of one period, counted in the extra length
    steps_a: dict[int, int] = {}
    steps_b: dict[int, int] = {}
    for program, counts in ((a, steps_a), (b, steps_b)):
        for action in program:
            if action.kind is Kind.STEP:
                counts[action.stage] = counts.get(action.stage, 0) + 1
    for stage in set(steps_a) | set(steps_b):
        versions[stage] = steps_b.get(stage, 0) - steps_a.get(stage, 0)
    probe = PeriodicProgram((), (), 0, (), units, versions)
    # smallest h with b[i + length] == shift(a[i]) for every i >= h
    h = len(a)
    while h > 0 and b[h - 1 + length] == probe.shift(a[h - 1], 1):
        h -= 1
    if h + length > len(b) or list(a[:h]) != list(b[:h]):
        return None
    return PeriodicProgram(a[:h], b[h:h + length], 0, a[h:], units, versions, rank=rank)


def period_units(name: str, microbatches: int, stages: int, replicas: Sequence[int] | None, chunks: int,
                 update_every: int) -> int:
    """Units per period for a schedule: a step for flushing ones and 2bw; for pipedream and pb a
    whole number of updates of every replica, at least twice the deepest warm-up."""
    if name not in ("pipedream", "pb"):
        return microbatches
    counts = list(replicas) if replicas else [1] * stages
    base = update_every * lcm(*counts)
    deepest = 2 * stages * max(counts) + 2 * sum(counts)
    return base * max(1, -(-2 * deepest // base))
