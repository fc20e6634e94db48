"""The weights an update makes, written into tensors no version needs any more.

An update writes into the current version's own tensors when the schedule releases that version
with the update (in place; nothing reads it any more), else into those of released versions
(:meth:`~pipetrain.execution.version_store.VersionStore.spares`), so that a stage never holds more
versions than its schedule says, and in steady state allocates none. A skipped update (a gradient
that is not finite, or float16's overflow) makes a version equal to the last: the same tensors
when the last is released, else a copy, so that both stay immutable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.execution.version_store import VersionStore

if TYPE_CHECKING:
    from pipetrain.execution.stage import StageExecutor

__all__ = ["updated_weights", "apply_update"]


def updated_weights(versions: VersionStore, grads: Mapping[str, Tensor], optimizer: Any, *, skip: bool,
                    in_place: bool, factor: float, samples_seen: int) -> dict[str, Tensor]:
    """The next version after ``versions.latest``: ``optimizer``'s step on ``grads`` times ``factor``
    (the sums are the caller's own, scaled in place), or the latest weights again when ``skip`` or
    without an optimizer; ``in_place``: the latest version's own tensors may be written."""
    current, number = versions.latest, versions.current
    if skip:
        if in_place:
            return current
        spares = versions.spares(current)  # a copy, into spares if any
        with torch.no_grad():
            return {n: spares[n].copy_(t) if n in spares else t.clone() for n, t in current.items()}
    if optimizer is None:
        return dict(current)
    if factor != 1.0:
        for grad in grads.values():
            if grad is not None:
                grad.mul_(factor)
    out: dict[str, Tensor] = {}
    if in_place:  # its tensors, unless shared with another version still held
        out = {n: current[n] for n in grads if versions.exclusive(number, n)}
    if len(out) < len(grads):
        out.update(versions.spares([n for n in grads if n not in out]))
    return optimizer.step(current, grads, samples_seen, out=out)


def apply_update(executor: StageExecutor, release: Sequence[int]) -> int:
    """:meth:`StageExecutor.step`: the versions in ``release`` dropped before the update (so that it
    writes into their tensors), the update made (or skipped, or the bookkeeping of one the backward
    made, :mod:`~pipetrain.execution.update_in_backward`), the counters moved; the new version's number."""
    grads = executor.grads or {}
    versions, number = executor.versions, executor.versions.current
    fused = executor.fused
    if fused is not None and fused.applied:  # the current version's tensors hold the new weights
        if not versions.releasing_current(release):
            raise PipetrainError(f"internal error: stage {executor.stage} updated version {number} in place during "
                                 f"the backward, but the schedule keeps it; please report this with the command")
        fused.finish()
        new = dict(versions.latest)
        _release_others(executor, release, number)
    else:
        # nothing reads the replaced version any more (its autograd leaves go with it), unless a
        # microbatch in flight will recompute its forward on it: then update in place
        awaited = executor.recompute and executor.in_flight.awaits_recomputation(number)
        in_place = versions.releasing_current(release) and not awaited
        _release_others(executor, release, number)
        if executor.scaling is not None:
            skip, unscale = executor.scaling.finish(number + 1, grads, executor.guard.check_skip_limit)
        else:
            skip, unscale = executor.guard.skips(number + 1, grads), 1.0
        new = updated_weights(versions, grads, executor.optimizer, skip=skip, in_place=in_place,
                              factor=executor.grad_scale * unscale,  # exact: the loss scale is a power of two
                              samples_seen=executor.samples_seen)
    executor.samples_seen += executor.pending_samples
    executor.pending_samples = 0
    executor.grads = None
    if number in release:
        executor.release(number)
    made = versions.push(new)
    executor.leaves.forget(versions, number)  # the push dropped it (released before)
    return made


def _release_others(executor: StageExecutor, release: Sequence[int], number: int) -> None:
    for version in release:
        if version != number:
            executor.release(version)
