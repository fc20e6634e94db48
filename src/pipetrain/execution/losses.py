"""The loss of every unit a rank computed, in 9 bytes per unit instead of a dictionary's ~100."""

from __future__ import annotations

from array import array
from typing import Iterator, Mapping, MutableMapping

__all__ = ["UnitLosses"]


class UnitLosses(MutableMapping[int, float]):
    """``{unit: loss}`` kept as an array of floats and one byte per unit saying which are held.

    A long run computes a loss per unit on its last stage, and the report lists every update's
    loss; as a dictionary, 100,000 units would take about 10 MB per copy (the rank's, the pickled
    message to rank 0, rank 0's). Non-finite losses (``--on-nonfinite skip``) are held as they are.
    """

    def __init__(self, items: Mapping[int, float] | None = None) -> None:
        self._values = array("d")
        self._held = bytearray()
        self._count = 0
        if items:
            self.update(items)

    def __setitem__(self, unit: int, loss: float) -> None:
        if unit < 0:
            raise KeyError(unit)
        grow = unit + 1 - len(self._held)
        if grow > 0:
            grow = max(grow, len(self._held) // 2)  # amortised
            self._values.extend([0.0] * grow)
            self._held.extend(bytes(grow))
        if not self._held[unit]:
            self._held[unit] = 1
            self._count += 1
        self._values[unit] = loss

    def __getitem__(self, unit: int) -> float:
        if 0 <= unit < len(self._held) and self._held[unit]:
            return self._values[unit]
        raise KeyError(unit)

    def __delitem__(self, unit: int) -> None:
        self[unit]  # noqa: B018 - raises KeyError if absent
        self._held[unit] = 0
        self._count -= 1

    def __contains__(self, unit: object) -> bool:
        return isinstance(unit, int) and 0 <= unit < len(self._held) and bool(self._held[unit])

    def __iter__(self) -> Iterator[int]:
        held = self._held
        return (unit for unit in range(len(held)) if held[unit])

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"UnitLosses({len(self)} units)"

    def __reduce__(self):  # as arrays (which pipetrain.runtime.share sends as tensors), less the spare room
        size = len(self._held.rstrip(b"\0"))
        return (_rebuilt, (self._values[:size], array("B", self._held[:size])))


def _rebuilt(values: array, held: array) -> UnitLosses:
    losses = UnitLosses()
    losses._values = values
    losses._held = bytearray(held)
    losses._count = sum(losses._held)
    return losses
