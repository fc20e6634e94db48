"""Versioned weights of one stage: immutable parameter dictionaries, whose buffers are reused for
later versions once no action reads them."""

from __future__ import annotations

from typing import Iterable, Sequence

from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.schedule.ir import Action, Kind, halves
from pipetrain.schedule.pattern import PeriodicProgram, ShiftedReleases

__all__ = ["VersionStore", "version_release_points"]

Params = dict[str, Tensor]


class VersionStore:
    """The weight versions a stage holds.

    Version ``v`` is the stage's weights after ``v`` updates. A version is never modified while it
    is held (autograd may have saved its tensors for a backward still to come); an update stores
    a new one. Old versions are dropped by :meth:`release` once their last reader has run.

    Why the store recycles: PipeDream's stages make a version per minibatch, out of place (the
    version before is still read by a backward in flight), and a fresh set of parameter tensors per
    update costs an allocation and first-touch page faults per update (a third more time per update
    than writing into warm memory, benchmarks/RESULTS.md section 3). A released version's tensors,
    unless another held version shares them (a parameter without a gradient keeps its tensor from
    version to version), become *spares*: :meth:`spares` hands them to the next update, which writes
    its new values into them. In steady state a stage then allocates no parameter memory at all;
    :attr:`allocated` counts the tensors the store had to take that were neither spares nor held
    already (the parameters of version 0 and of the first updates that found no spare).
    """

    def __init__(self, initial: Params, *, first: int = 0, recycle: bool = True) -> None:
        self._versions: dict[int, Params] = {}
        self._holders: dict[int, int] = {}  # id(tensor) -> number of held versions holding it
        self._spare: dict[str, list[Tensor]] = {}  # name -> tensors of released versions, free to reuse
        self._lent: dict[int, tuple[str, Tensor]] = {}  # spares handed out by spares(), until the next push
        self.recycle = recycle
        #: tensors taken into the store that were neither spares nor held already (see the class docstring)
        self.allocated = 0
        #: tensors of released versions written again by a later version
        self.reused = 0
        self.current = first
        self._hold(first, initial)
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
        self._hold(self.current + 1, params)
        if self._release_on_push:
            self._release_on_push = False
            self._drop(self.current)
        self.current += 1
        self.peak = max(self.peak, len(self._versions))
        return self.current

    def release(self, version: int) -> None:
        """Drop ``version``; the current version is kept until a newer one is pushed."""
        if version != self.current:
            self._drop(version)
        else:
            self._release_on_push = True

    def releasing_current(self, release: Iterable[int]) -> bool:
        """Whether the current version goes once the next version is pushed, with ``release``
        dropped: then the next update may write into its tensors in place (see :meth:`exclusive`)."""
        return self._release_on_push or self.current in release

    def exclusive(self, version: int, name: str) -> bool:
        """Whether ``version``'s tensor of ``name`` is held by that version alone (no other held
        version shares it), so that writing into it once the version goes disturbs no other."""
        return self._holders.get(id(self._versions[version][name]), 0) == 1

    def spares(self, names: Iterable[str]) -> dict[str, Tensor]:
        """Tensors of released versions for the next version's ``names`` to be written into (those
        without a spare are missing: the update allocates them). They are the caller's to write until
        the next :meth:`push`; any that the pushed version does not hold are spares again."""
        out: dict[str, Tensor] = {}
        if not self._spare:
            return out
        for name in names:
            free = self._spare.get(name)
            while free:
                tensor = free.pop()
                if self._holders.get(id(tensor)):  # held again since (pushed without being lent): not spare
                    continue
                out[name] = tensor
                self._lent[id(tensor)] = (name, tensor)
                break
            if not free:
                self._spare.pop(name, None)
        return out

    def held(self) -> list[int]:
        return sorted(self._versions)

    def holds(self, version: int) -> bool:
        return version in self._versions

    def state(self) -> dict[int, Params]:
        """All held versions (for checkpoints)."""
        return dict(self._versions)

    @classmethod
    def from_state(cls, versions: dict[int, Params], current: int, *, recycle: bool = True) -> "VersionStore":
        """A store holding ``versions`` (from :meth:`state`, possibly saved and loaded again). Tensors
        of different versions that share memory (a loaded checkpoint gives each its own object) become
        one object, so that the store sees them as shared; a partial overlap is copied apart."""
        store = cls({}, first=current, recycle=recycle)
        store._versions.clear()
        seen: dict[tuple, Tensor] = {}
        storages: set[int] = set()
        for version in sorted(versions):
            params: Params = {}
            for name, tensor in versions[version].items():
                pointer = tensor.untyped_storage().data_ptr()
                key = (pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
                if key in seen:
                    tensor = seen[key]
                elif pointer in storages and tensor.numel():
                    tensor = tensor.clone()
                else:
                    seen[key] = tensor
                    storages.add(pointer)
                params[name] = tensor
            store._hold(version, params, count=False)
        store.peak = len(versions)
        return store

    # -- bookkeeping -------------------------------------------------------------------------------

    def _hold(self, version: int, params: Params, count: bool = True) -> None:
        holders, lent = self._holders, self._lent
        for tensor in params.values():
            key = id(tensor)
            held = holders.get(key, 0)
            if held == 0:
                if lent.pop(key, None) is not None:
                    self.reused += 1
                elif count:
                    self.allocated += 1
            holders[key] = held + 1
        for name, tensor in lent.values():  # lent but not written (its update found no gradient)
            self._spare.setdefault(name, []).append(tensor)
        lent.clear()
        self._versions[version] = params

    def _drop(self, version: int) -> None:
        params = self._versions.pop(version, None)
        if params is None:
            return
        holders = self._holders
        for name, tensor in params.items():
            key = id(tensor)
            left = holders[key] - 1
            if left:
                holders[key] = left
                continue
            del holders[key]
            if self.recycle:
                self._spare.setdefault(name, []).append(tensor)


def version_release_points(program: Sequence[Action]) -> dict[int, list[tuple[int, int]]]:
    """For one rank's program: after which positions which (stage, version) pairs can be released.

    A version is released after its last read or at the STEP that supersedes it, whichever is
    later. For a long program expanded from a pattern, a table read off the sample's
    (:class:`~pipetrain.schedule.pattern.ShiftedReleases`).
    """
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
        elif action.kind is Kind.FB:  # a pair reads a version for each half
            for half in halves(action):
                last_read[(half.stage, half.version)] = position
        elif action.version is not None:
            last_read[(action.stage, action.version)] = position
    releases: dict[int, list[tuple[int, int]]] = {}
    for key, step_position in superseded.items():
        position = max(step_position, last_read.get(key, -1))
        releases.setdefault(position, []).append(key)
    return releases
