"""Stacked kernels: forward and hand-written backward for G weight sets at once.

The batched PB engine runs, in one tick, the same unit of many stages (and of many independent
runs), each with its own weights and its own sample. A kernel computes such a unit for all G
members with one operation per layer instead of G: weights are stacked ``[G, *shape]``,
activations ``[G, B, *features]`` (B samples per member, 1 for PB).

The backward is written by hand so that it can read weights and activations of different times,
as Pipelined Backpropagation needs: ``backward(params, saved, grad_out)`` propagates the error
through ``params`` (the weights current at backward time) while weight gradients use ``saved``,
the activations kept from the forward (which may have run on other, older or predicted, weights).
Kernels never keep weights in ``saved``, so the engine may update weights in place.

Each kernel is bound to the per-sample input shape before use (:meth:`Kernel.bind`), which
checks the layer accepts it and gives the output shape, and prepares the views of a set of
stacked parameter buffers it computes with once (:meth:`Kernel.prepare`): the engine updates
those buffers in place, so the views stay valid and no tick pays for making them again.

A weight gradient may come back as an :class:`Outer` (``a @ b``, not yet multiplied): the engine
then adds it straight into the momentum buffer (``v <- m*v + a @ b`` in one ``baddbmm``) instead
of writing the gradient and reading it again.

The layers are in :mod:`pipetrain.pb.layer_kernels`, the compositions (sequences and residual
blocks) in :mod:`pipetrain.pb.block_kernels`; :mod:`pipetrain.pb.lowering` maps modules to them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["Kernel", "Outer", "Shape", "materialize", "prefixed"]

Shape = tuple[int, ...]


class Outer:
    """A weight gradient ``a @ b`` (batched, ``[G, out, rows] @ [G, rows, in]``) left unmultiplied;
    ``shape``: the weight's ``[G, *shape]`` when it is not ``[G, out, in]`` (a convolution's)."""

    __slots__ = ("a", "b", "shape")

    def __init__(self, a: Tensor, b: Tensor, shape: tuple[int, ...] | None = None) -> None:
        self.a = a
        self.b = b
        self.shape = shape

    def tensor(self) -> Tensor:
        product = torch.bmm(self.a, self.b)
        return product if self.shape is None else product.view(self.shape)


def materialize(grad: "Tensor | Outer") -> Tensor:
    """The gradient as a tensor."""
    return grad.tensor() if isinstance(grad, Outer) else grad


class Kernel:
    """One layer (or composition) for G members at once.

    ``params`` lists ``(name, per-member shape)`` in a fixed order. :meth:`prepare` turns the
    stacked parameter tensors (``[G, *shape]``, in that order) into the context that
    :meth:`forward` and :meth:`backward` compute with.
    """

    params: tuple[tuple[str, Shape], ...] = ()
    #: number of tensors :meth:`forward` returns in ``saved`` (each with the G members first)
    num_saved: int = 0

    def bind(self, in_shape: Shape) -> Shape:
        """Fix the per-sample input shape; returns the per-sample output shape."""
        self.in_shape = tuple(in_shape)
        self.out_shape = self._bind(self.in_shape)
        return self.out_shape

    def _bind(self, in_shape: Shape) -> Shape:
        return in_shape

    def signature(self) -> str:
        """Structure and sizes: units with equal signatures can be stacked."""
        return f"{type(self).__name__}{self._config()}{self.params}"

    def _config(self) -> tuple:
        return ()

    def prepare(self, p: Sequence[Tensor]) -> Any:
        """Views of the stacked parameters used by forward and backward (made once per buffer)."""
        return list(p)

    def forward(self, p: Any, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        raise NotImplementedError

    def backward(
        self, p: Any, saved: Sequence[Tensor], gy: Tensor, need_gx: bool
    ) -> tuple[Tensor | None, list[Tensor | Outer]]:
        """Input gradient (``None`` unless ``need_gx``) and weight gradients in ``params`` order."""
        raise NotImplementedError


def prefixed(prefix: str, params: tuple[tuple[str, Shape], ...]) -> tuple[tuple[str, Shape], ...]:
    return tuple((f"{prefix}.{name}" if prefix else name, shape) for name, shape in params)
