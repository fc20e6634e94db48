"""Versioned weights of one stage: immutable parameter dictionaries, freed when no longer read."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.schedule.ir import Action, Kind

__all__ = ["VersionStore", "version_release_points"]

Params = dict[str, Tensor]


class VersionStore:
    """The weight versions a stage holds.

    Version ``v`` is the stage's weights after ``v`` updates. A version is never modified after it
    is stored (autograd may have saved its tensors for a backward still to come); an update stores
    a new one. Old versions are dropped by :meth:`release` once their last reader has run.
    """

    def __init__(self, initial: Params, *, first: int = 0) -> None:
        self._versions: dict[int, Params] = {first: initial}
        self.current = first
        self.peak = 1
        self._release_on_push = False

    def __getitem__(self, version: int) -> Params:
        try:
            return self._versions[version]
        except KeyError:
            held = sorted(self._versions)
            raise PipetrainError(
                f"weight version {version} is not held (held: {held}); the schedule reads a version that was "
                "never made or was already released"
            ) from None

    @property
    def latest(self) -> Params:
        return self._versions[self.current]

    def push(self, params: Params) -> int:
        """Store the next version and make it current; returns its number."""
        if self._release_on_push:
            self._versions.pop(self.current, None)
            self._release_on_push = False
        self.current += 1
        self._versions[self.current] = params
        self.peak = max(self.peak, len(self._versions))
        return self.current

    def release(self, version: int) -> None:
        """Drop ``version``; the current version is kept until a newer one is pushed."""
        if version != self.current:
            self._versions.pop(version, None)
        else:
            self._release_on_push = True

    def held(self) -> list[int]:
        return sorted(self._versions)

    def state(self) -> dict[int, Params]:
        """All held versions (for checkpoints)."""
        return dict(self._versions)

    @classmethod
    def from_state(cls, versions: dict[int, Params], current: int) -> "VersionStore":
        store = cls(versions[current], first=current)
        store._versions = dict(versions)
        store.peak = len(versions)
        return store


def version_release_points(program: Sequence[Action]) -> dict[int, list[tuple[int, int]]]:
    """For one rank's program: after which positions which (stage, version) pairs can be released.

    A version is released after its last read or at the STEP that supersedes it, whichever is
    later. For a long program expanded from a pattern, a table read off the sample's
    (:class:`~pipetrain.schedule.pattern.ShiftedReleases`).
    """
    from pipetrain.schedule.pattern import PeriodicProgram, ShiftedReleases

    if isinstance(program, PeriodicProgram) and program.pattern is not None:
        sample = program.pattern.sample.programs[program.rank]
        table = program.pattern.cached(("releases", program.rank), lambda: version_release_points(sample))
        return ShiftedReleases(program, table)  # type: ignore[return-value]
    last_read: dict[tuple[int, int], int] = {}
    superseded: dict[tuple[int, int], int] = {}  # (stage, v) -> position of the STEP making v + 1
    counts: dict[int, int] = {}
    for position, action in enumerate(program):
        if action.kind is Kind.STEP:
            version = counts.get(action.stage, 0)
            counts[action.stage] = version + 1
            superseded[(action.stage, version)] = position
        elif action.version is not None:
            last_read[(action.stage, action.version)] = position
    releases: dict[int, list[tuple[int, int]]] = {}
    for key, step_position in superseded.items():
        position = max(step_position, last_read.get(key, -1))
        releases.setdefault(position, []).append(key)
    return releases
