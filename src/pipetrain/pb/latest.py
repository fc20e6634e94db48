"""The `latest` backward for any module: saved parameters are read at backward time.

Pipelined Backpropagation hardware propagates the error of a sample through the weights a stage
holds when the backward runs, which are ``D_s`` updates newer than the weights its forward used,
while each weight gradient combines that error with the activations stored at forward time.
Autograd saves both kinds of tensors during the forward; :class:`LatestWeights` tells them apart
with saved-tensor hooks. A saved tensor that shares storage with one of the forward's parameter
tensors (the parameter itself or a view, such as the ``W.t()`` that ``addmm`` saves) is packed as a
reference (name, size, stride, offset) and unpacked as the same view of the parameter current at
backward time; every other saved tensor keeps its forward-time value.

This is exact for every layer whose backward reads the parameter tensor (or a view of it): Linear,
ConvNd, embeddings, the affine parameters of GroupNorm / LayerNorm, elementwise ``x * w``. A layer
that saves a tensor *computed* from a parameter (weight normalisation's ``g * v / |v|``, a
parameter cast to another dtype, ``w.exp()``) keeps the forward-time value of that tensor: its
input gradient then uses the forward weights for that part.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

import torch
from torch import Tensor

__all__ = ["LatestWeights"]


class _Ref:
    """A saved tensor that was (a view of) parameter ``name``, resolved at backward time."""

    __slots__ = ("name", "size", "stride", "offset")

    def __init__(self, name: str, size: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.name = name
        self.size = size
        self.stride = stride
        self.offset = offset  # storage offset relative to the parameter's own offset


class LatestWeights:
    """Saved-tensor hooks that make a backward read the weights current at backward time.

    ``forward_params`` are the tensors the forward computes with; ``current`` returns, when the
    backward runs, the parameter dictionary to read instead (same names, same shapes). Several
    parameters may share one storage (views into a flat buffer): each saved tensor is matched to
    the parameter whose storage range holds its first element.

    >>> hooks = LatestWeights(fwd, lambda: stage.current)      # doctest: +SKIP
    >>> with hooks:                                             # doctest: +SKIP
    ...     out = functional_call(module, fwd, (x,))
    """

    def __init__(
        self, forward_params: Mapping[str, Tensor], current: Callable[[], Mapping[str, Tensor]]
    ) -> None:
        self.current = current
        self._ranges: dict[int, list[tuple[int, int, str, int]]] = {}
        for name, tensor in forward_params.items():
            if tensor.numel() == 0:
                continue
            start = tensor.storage_offset()
            span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            ptr = tensor.untyped_storage().data_ptr()
            self._ranges.setdefault(ptr, []).append((start, start + span, name, start))
        self._context: contextlib.AbstractContextManager | None = None

    def _pack(self, tensor: Tensor) -> object:
        ranges = self._ranges.get(tensor.untyped_storage().data_ptr())
        if ranges is None:
            return tensor
        offset = tensor.storage_offset()
        for start, stop, name, base in ranges:
            if start <= offset < stop:
                return _Ref(name, tensor.size(), tensor.stride(), offset - base)
        return tensor

    def _unpack(self, saved: object) -> Tensor:
        if isinstance(saved, _Ref):
            param = self.current()[saved.name].detach()
            return param.as_strided(saved.size, saved.stride, param.storage_offset() + saved.offset)
        return saved  # type: ignore[return-value]

    def __enter__(self) -> "LatestWeights":
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._context is not None
        self._context.__exit__(*exc)
        self._context = None
