"""Stacked kernels that compose others: a sequence, and the residual block with its shortcut and halves.

A composition's parameters and saved tensors are its children's, in order; see
:mod:`pipetrain.pb.kernels` for the contract.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.pb.kernels import Kernel, Shape, prefixed

__all__ = ["Chain", "Residual", "Shortcut", "Fork", "Join"]


class Chain(Kernel):
    """Children applied one after the other (``nn.Sequential``)."""

    def __init__(self, children: Sequence[tuple[str, Kernel]]) -> None:
        self.children = list(children)
        params: list[tuple[str, Shape]] = []
        self._param_slices: list[slice] = []
        self._saved_slices: list[slice] = []
        saved = 0
        for name, child in self.children:
            self._param_slices.append(slice(len(params), len(params) + len(child.params)))
            params.extend(prefixed(name, child.params))
            self._saved_slices.append(slice(saved, saved + child.num_saved))
            saved += child.num_saved
        self.params = tuple(params)
        self.num_saved = saved

    def signature(self) -> str:
        inner = ",".join(f"{name}:{child.signature()}" for name, child in self.children)
        return f"Chain[{inner}]"

    def _bind(self, in_shape: Shape) -> Shape:
        shape = in_shape
        for _, child in self.children:
            shape = child.bind(shape)
        return shape

    def prepare(self, p):
        return [child.prepare(p[ps]) for (_, child), ps in zip(self.children, self._param_slices)]

    def forward(self, p, x):
        saved: list[Tensor] = []
        for (_, child), context in zip(self.children, p):
            x, s = child.forward(context, x)
            saved.extend(s)
        return x, saved

    def backward(self, p, saved, gy, need_gx):
        grads: list[list] = []
        for index in range(len(self.children) - 1, -1, -1):
            child = self.children[index][1]
            gy, g = child.backward(p[index], saved[self._saved_slices[index]], gy, need_gx or index > 0)
            grads.append(g)
        return gy, [t for g in reversed(grads) for t in g]


class _Around(Kernel):
    """A kernel around one ``inner`` kernel whose parameters and saved tensors are the inner's."""

    def __init__(self, inner: Kernel) -> None:
        self.inner = inner
        self.params = inner.params
        self.num_saved = inner.num_saved

    def prepare(self, p):
        return self.inner.prepare(p)


class Residual(_Around):
    """``y = shortcut(x) + inner(x)``; the shortcut (a parameter-free kernel) is the identity
    unless given."""

    def __init__(self, inner: Kernel, shortcut: "Shortcut | None" = None) -> None:
        super().__init__(inner)
        self.shortcut = shortcut

    def signature(self) -> str:
        short = "" if self.shortcut is None else f"{self.shortcut.signature()},"
        return f"Residual[{short}{self.inner.signature()}]"

    def _bind(self, in_shape: Shape) -> Shape:
        out = self.inner.bind(in_shape)
        short = tuple(in_shape) if self.shortcut is None else self.shortcut.bind(in_shape)
        if out != short:
            raise PipetrainError(f"residual branch gives shape {out}, its shortcut {short} (input {in_shape})")
        return out

    def forward(self, p, x):
        y, saved = self.inner.forward(p, x)
        return (x if self.shortcut is None else self.shortcut.forward(None, x)[0]) + y, saved

    def backward(self, p, saved, gy, need_gx):
        gx, grads = self.inner.backward(p, saved, gy, need_gx)
        if not need_gx:
            return None, grads
        return gx + (gy if self.shortcut is None else self.shortcut.backward(None, (), gy, True)[0]), grads


class Shortcut(Kernel):
    """A residual block's parameter-free shortcut (:class:`pipetrain.models.Shortcut`): every
    ``stride``-th pixel of ``(C, H, W)`` input, zero channels appended up to ``out_channels``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.stride = stride

    def _config(self) -> tuple:
        return (self.in_channels, self.out_channels, self.stride)

    def _bind(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 3 or in_shape[0] != self.in_channels:
            raise PipetrainError(f"Shortcut({self.in_channels}, ...) needs (C, H, W) input, got {in_shape}")
        s = self.stride
        return (self.out_channels, -(-in_shape[1] // s), -(-in_shape[2] // s))

    def prepare(self, p):
        return None

    def forward(self, p, x):
        s = self.stride
        if s != 1:
            x = x[..., ::s, ::s]
        if self.out_channels != self.in_channels:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, self.out_channels - self.in_channels))
        return x, []

    def backward(self, p, saved, gy, need_gx):
        if not need_gx:
            return None, []
        if self.out_channels != self.in_channels:
            gy = gy[:, :, : self.in_channels]
        s = self.stride
        if s == 1:
            return gy, []
        gx = gy.new_zeros(gy.shape[:2] + self.in_shape)
        gx[..., ::s, ::s] = gy
        return gx, []


class Fork(_Around):
    """``cat(shortcut(x), branch(x))`` on the channels: the first half of a residual block cut
    into two units, which hands its shortcut on with the branch's (``inner``) activations."""

    def __init__(self, shortcut: Shortcut, branch: Kernel) -> None:
        super().__init__(branch)
        self.shortcut = shortcut

    def signature(self) -> str:
        return f"Fork[{self.shortcut.signature()},{self.inner.signature()}]"

    def _bind(self, in_shape: Shape) -> Shape:
        short = self.shortcut.bind(in_shape)
        out = self.inner.bind(in_shape)
        if len(out) < 1 or out[1:] != short[1:]:
            raise PipetrainError(f"fork: branch gives {out}, shortcut {short}; they must differ in channels only")
        self._split = short[0]
        return (short[0] + out[0],) + tuple(out[1:])

    def forward(self, p, x):
        y, saved = self.inner.forward(p, x)
        return torch.cat([self.shortcut.forward(None, x)[0], y], 2), saved

    def backward(self, p, saved, gy, need_gx):
        gs, gb = gy[:, :, : self._split], gy[:, :, self._split :]
        gx, grads = self.inner.backward(p, saved, gb, need_gx)
        if not need_gx:
            return None, grads
        return gx + self.shortcut.backward(None, (), gs, True)[0], grads


class Join(_Around):
    """``x[:channels] + inner(x[channels:])`` on the channels: the second half of a residual
    block cut into two units (its input is a :class:`Fork`'s output)."""

    def __init__(self, inner: Kernel, channels: int) -> None:
        super().__init__(inner)
        self.channels = channels

    def signature(self) -> str:
        return f"Join[{self.channels},{self.inner.signature()}]"

    def _bind(self, in_shape: Shape) -> Shape:
        c = self.channels
        if len(in_shape) < 1 or in_shape[0] <= c:
            raise PipetrainError(f"join of {c} shortcut channels got input {in_shape}")
        out = self.inner.bind((in_shape[0] - c,) + tuple(in_shape[1:]))
        if out != (c,) + tuple(in_shape[1:]):
            raise PipetrainError(f"join: the branch gives {out}, the shortcut {(c,) + tuple(in_shape[1:])}")
        return out

    def forward(self, p, x):
        c = self.channels
        y, saved = self.inner.forward(p, x[:, :, c:].contiguous())
        return x[:, :, :c] + y, saved

    def backward(self, p, saved, gy, need_gx):
        gx, grads = self.inner.backward(p, saved, gy, need_gx)
        return (torch.cat([gy, gx], 2) if need_gx else None), grads
