"""The weights an update makes, written into tensors no version needs any more.

An update writes into the current version's own tensors when the schedule releases that version
with the update (in place; nothing reads it any more), else into those of released versions
(:meth:`~pipetrain.execution.versions.VersionStore.spares`), so that a stage never holds more
versions than its schedule says, and in steady state allocates none. A skipped update (a gradient
that is not finite, or float16's overflow) makes a version equal to the last: the same tensors
when the last is released, else a copy, so that both stay immutable.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from pipetrain.execution.versions import VersionStore

__all__ = ["updated_weights"]


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
