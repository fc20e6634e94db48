"""Python objects gathered to one rank or broadcast from it, their large arrays sent as tensors.

``torch.distributed.gather_object`` and ``broadcast_object_list`` pickle an object into a byte
tensor: the per-update figures a run hands to rank 0 at its end (arrays of 100,000 floats: losses,
update times) are then copied about six times on the way (the pickle, its tensor, the tensor
padded to the largest rank's size, the bytes read back, their slice, the unpickled array): about
100 bytes an update at the end of a run that held 17 bytes an update while it trained. Here an
object is pickled without its large ``array.array`` values, that pickle travels as before, and
each of those arrays travels as a tensor sharing its memory on both ends: the receiver allocates
the array and receives straight into it.
"""

from __future__ import annotations

import io
import pickle
from array import array
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_to", "broadcast_from"]

#: arrays of fewer items stay in the pickle
LARGE = 4096


class _Pickler(pickle.Pickler):
    """Pickles an object, leaving out (and collecting) its large arrays."""

    def __init__(self, file: io.BytesIO, arrays: list[array]) -> None:
        super().__init__(file)
        self.arrays = arrays
        self._index: dict[int, int] = {}  # id of an array left out -> its place (an array met twice is sent once)

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is array and len(obj) >= LARGE and obj.typecode != "u":
            index = self._index.get(id(obj))
            if index is None:
                index = self._index[id(obj)] = len(self.arrays)
                self.arrays.append(obj)
            return index
        return None


class _Unpickler(pickle.Unpickler):
    """Unpickles what :class:`_Pickler` wrote, given the arrays it left out."""

    def __init__(self, file: io.BytesIO, arrays: list[array]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid: int) -> array:
        return self.arrays[pid]


def _pack(obj: Any) -> tuple[bytes, list[array]]:
    arrays: list[array] = []
    buffer = io.BytesIO()
    _Pickler(buffer, arrays).dump(obj)
    return buffer.getvalue(), arrays


def _unpack(data: bytes, arrays: list[array]) -> Any:
    return _Unpickler(io.BytesIO(data), arrays).load()


def _shapes(arrays: list[array]) -> list[tuple[str, int]]:
    return [(values.typecode, len(values)) for values in arrays]


def _allocated(shapes: list[tuple[str, int]]) -> list[array]:
    return [array(typecode, [0]) * length for typecode, length in shapes]


def _tensor(values: array) -> torch.Tensor:
    """The array's bytes as a tensor (the same memory: a receive fills the array)."""
    return torch.frombuffer(values, dtype=torch.uint8)


def gather_to(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank ``dst`` (None elsewhere): as
    ``dist.gather_object``, with the objects' large arrays sent as tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data, arrays = _pack(obj)
    gathered: list[Any] | None = [None] * world if rank == dst else None
    dist.gather_object((data, _shapes(arrays)), gathered, dst=dst)
    if rank != dst:
        for values in arrays:
            dist.send(_tensor(values), dst=dst)
        return None
    assert gathered is not None
    objects = []
    for source, (pickled, shapes) in enumerate(gathered):
        if source == dst:
            objects.append(_unpack(pickled, arrays))
            continue
        received = _allocated(shapes)
        for values in received:
            dist.recv(_tensor(values), src=source)
        objects.append(_unpack(pickled, received))
    return objects


def broadcast_from(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src`` gets ``obj`` itself): as
    ``dist.broadcast_object_list``, with the object's large arrays sent as tensors."""
    rank = dist.get_rank()
    arrays: list[array] = []
    header: list[Any] = [None]
    if rank == src:
        data, arrays = _pack(obj)
        header = [(data, _shapes(arrays))]
    dist.broadcast_object_list(header, src=src)
    data, shapes = header[0]
    if rank != src:
        arrays = _allocated(shapes)
    for values in arrays:
        dist.broadcast(_tensor(values), src=src)
    return obj if rank == src else _unpack(data, arrays)
