"""Batched optimizer arithmetic that rounds exactly as the single-tensor path: foreach calls, and
writes into given buffers.

Why: an update of a stage with P parameters was P rounds of Python calls (a few microseconds
each, a visible share of an update where a minibatch takes a millisecond), and on versioned
schedules it allocated a fresh tensor per parameter. Here one ``torch._foreach_*`` call covers
every parameter, and results go into the tensors the caller gives (``outs``): the parameter
itself for an update in place, or a buffer of a released version (see
:class:`~pipetrain.execution.VersionStore`).

Exactness: on CPU, ``torch._foreach_X_`` runs ``X_`` on each tensor in turn (there is no fused CPU
kernel), and an in-place op computes with the very kernel of its out-of-place twin, so every
element rounds as in the single-tensor path; ``tests/test_optim_fused.py`` checks it bitwise
against that path and against ``torch.optim`` for every option. On other devices foreach calls
run fused kernels whose rounding has not been checked against the single-tensor path, so
:func:`available` says no there and the optimizers keep their per-tensor path.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["available", "add_into", "mul_into", "addcdiv_into", "Scratch"]

Outs = Sequence["Tensor | None"]


def available(tensors: Sequence[Tensor]) -> bool:
    """Whether the batched path computes exactly the single-tensor path's values for ``tensors``
    (all on the CPU)."""
    return all(t.is_cpu for t in tensors)  # (not t.device: a device object per tensor costs 5x more)


def _groups(outs: Outs, bases: Sequence[Tensor]) -> tuple[list[int], list[int], list[int]]:
    """Positions written in place (``out is base``), into a new tensor (``out`` None), and into
    another given buffer."""
    same, fresh, other = [], [], []
    for i, (out, base) in enumerate(zip(outs, bases)):
        (same if out is base else fresh if out is None else other).append(i)
    return same, fresh, other


def _pick(values: Sequence, positions: list[int], everything: bool) -> list:
    return list(values) if everything else [values[i] for i in positions]


def add_into(outs: Outs, bases: Sequence[Tensor], others: Sequence[Tensor], alpha: float) -> list[Tensor]:
    """``torch.add(bases[i], others[i], alpha=alpha, out=outs[i])`` for every i (a new tensor where
    ``outs[i]`` is None); returns the results."""
    results: list[Tensor] = list(outs)  # type: ignore[arg-type]
    same, fresh, other = _groups(outs, bases)
    n = len(bases)
    if same:
        torch._foreach_add_(_pick(bases, same, len(same) == n), _pick(others, same, len(same) == n), alpha=alpha)
        for i in same:
            results[i] = bases[i]
    if fresh:
        made = torch._foreach_add(_pick(bases, fresh, len(fresh) == n), _pick(others, fresh, len(fresh) == n),
                                  alpha=alpha)
        for i, tensor in zip(fresh, made):
            results[i] = tensor
    for i in other:  # out of place into a buffer: one call each (a copy first would cost a pass over it)
        torch.add(bases[i], others[i], alpha=alpha, out=outs[i])
    return results


def mul_into(outs: Outs, bases: Sequence[Tensor], factor: float) -> list[Tensor]:
    """``torch.mul(bases[i], factor, out=outs[i])`` for every i (a new tensor where ``outs[i]`` is
    None); returns the results."""
    results: list[Tensor] = list(outs)  # type: ignore[arg-type]
    same, fresh, other = _groups(outs, bases)
    if same:
        torch._foreach_mul_([bases[i] for i in same], factor)
        for i in same:
            results[i] = bases[i]
    if fresh:
        for i, tensor in zip(fresh, torch._foreach_mul([bases[i] for i in fresh], factor)):
            results[i] = tensor
    for i in other:
        torch.mul(bases[i], factor, out=outs[i])
    return results


def addcdiv_into(outs: Outs, bases: Sequence[Tensor], numerators: Sequence[Tensor], denominators: Sequence[Tensor],
                 values: Sequence[float]) -> list[Tensor]:
    """``torch.addcdiv(bases[i], numerators[i], denominators[i], value=values[i], out=outs[i])`` for
    every i (a new tensor where ``outs[i]`` is None); returns the results."""
    results: list[Tensor] = list(outs)  # type: ignore[arg-type]
    same, fresh, other = _groups(outs, bases)
    for group, inplace in ((same, True), (fresh, False)):
        if not group:
            continue
        args = ([bases[i] for i in group], [numerators[i] for i in group], [denominators[i] for i in group],
                [values[i] for i in group])
        if inplace:
            torch._foreach_addcdiv_(*args)
            made = args[0]
        else:
            made = torch._foreach_addcdiv(*args)
        for i, tensor in zip(group, made):
            results[i] = tensor
    for i in other:
        torch.addcdiv(bases[i], numerators[i], denominators[i], value=values[i], out=outs[i])
    return results


class Scratch:
    """Parameter-sized working tensors an optimizer reuses from update to update (a weight-decayed
    gradient, a Nesterov direction, Adam's denominator), instead of allocating them per update.
    Not optimizer state: nothing in them survives an update, and checkpoints leave them out."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[str, str], Tensor] = {}

    def get(self, slot: str, names: Sequence[str], like: Sequence[Tensor]) -> list[Tensor]:
        """One tensor per name for ``slot``, shaped like ``like`` (made on first use)."""
        tensors = self._tensors
        out = []
        for name, model in zip(names, like):
            tensor = tensors.get((slot, name))
            if tensor is None or tensor.shape != model.shape or tensor.dtype != model.dtype:
                tensor = tensors[(slot, name)] = torch.empty_like(model, memory_format=torch.preserve_format)
            out.append(tensor)
        return out
