"""Stacked kernels of single layers: linear, normalisation, activations, reshapes, convolution, pooling.

Each is a :class:`~pipetrain.pb.kernels.Kernel` for G weight sets at once (see that module for the
contract: hand-written backward through the current weights, weight gradients from the saved
activations).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.pb.kernels import Kernel, Outer, Shape

__all__ = ["Linear", "GroupNorm", "LayerNorm", "Activation", "Reshape", "Conv2d", "GlobalAvgPool"]

aten = torch.ops.aten
_CONSTANTS: dict[tuple[float, torch.dtype], Tensor] = {}


def _constant(value: float, dtype: torch.dtype) -> Tensor:
    """A cached 0-d tensor: multiplying by it is cheaper than by a Python float."""
    key = (value, dtype)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.tensor(value, dtype=dtype)
    return tensor


class Linear(Kernel):
    """``y = x W^T + b`` on the last dimension; ``W`` is ``[out, in]``."""

    num_saved = 1

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        params: list[tuple[str, Shape]] = [("weight", (out_features, in_features))]
        if bias:
            params.append(("bias", (out_features,)))
        self.params = tuple(params)

    def _config(self) -> tuple:
        return (self.in_features, self.out_features, self.bias)

    def _bind(self, in_shape: Shape) -> Shape:
        if not in_shape or in_shape[-1] != self.in_features:
            raise PipetrainError(f"Linear({self.in_features}, {self.out_features}) got input {in_shape}")
        return in_shape[:-1] + (self.out_features,)

    def prepare(self, p):
        return (p[0], p[0].transpose(1, 2), p[1].unsqueeze(1) if self.bias else None)

    def forward(self, p, x):
        _, weight_t, bias = p
        x3 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, self.in_features)
        y = torch.baddbmm(bias, x3, weight_t) if bias is not None else torch.bmm(x3, weight_t)
        return (y if x.dim() == 3 else y.view(x.shape[:-1] + (self.out_features,))), [x3]

    def backward(self, p, saved, gy, need_gx):
        x3 = saved[0]
        g, rows = x3.shape[0], x3.shape[1]
        gy3 = gy if gy.dim() == 3 else gy.reshape(g, rows, self.out_features)
        grads: list[Tensor | Outer] = [Outer(gy3.transpose(1, 2), x3)]
        if self.bias:
            grads.append(gy3.view(g, self.out_features) if rows == 1 else gy3.sum(1))
        gx = None
        if need_gx:
            gx = torch.bmm(gy3, p[0])
            if gy.dim() != 3:
                gx = gx.view(gy.shape[:-1] + (self.in_features,))
        return gx, grads


def _reduce_to(t: Tensor, keep: int, dims: tuple[int, ...]) -> Tensor:
    """Sum ``t`` over ``dims`` (skipping a plain reshape when they all have size 1)."""
    if all(t.shape[d] == 1 for d in dims):
        return t.reshape(t.shape[0], keep)
    return t.sum(dims).reshape(t.shape[0], keep)


class GroupNorm(Kernel):
    """GroupNorm over ``[B, C, *spatial]`` per sample, with per-member affine parameters."""

    num_saved = 4

    def __init__(self, num_groups: int, num_channels: int, eps: float, affine: bool) -> None:
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        self.params = (("weight", (num_channels,)), ("bias", (num_channels,))) if affine else ()

    def _config(self) -> tuple:
        return (self.num_groups, self.num_channels, self.eps, self.affine)

    def _bind(self, in_shape: Shape) -> Shape:
        if not in_shape or in_shape[0] != self.num_channels:
            raise PipetrainError(f"GroupNorm over {self.num_channels} channels got input {in_shape}")
        self._spatial = math.prod(in_shape[1:])
        self._affine_shape = (self.num_channels,) + (1,) * (len(in_shape) - 1)
        self._sum_dims = tuple(d for d in range(1, len(in_shape) + 2) if d != 2)
        return in_shape

    def prepare(self, p):
        if not self.affine:
            return None
        shape = (p[0].shape[0], 1) + self._affine_shape
        return (p[0].view(shape), p[1].view(shape))

    def forward(self, p, x):
        # the native kernel reads [N, C, *] memory as N x C x HW: [G, B, C, *] is that for N = G*B
        x = x.contiguous()
        yhat, mean, rstd = torch.native_group_norm(
            x, None, None, x.shape[0] * x.shape[1], self.num_channels, self._spatial, self.num_groups, self.eps
        )
        if p is None:
            return yhat, [x, mean, rstd, yhat]
        return torch.addcmul(p[1], yhat, p[0]), [x, mean, rstd, yhat]

    def backward(self, p, saved, gy, need_gx):
        x, mean, rstd, yhat = saved
        grads: list[Tensor | Outer] = []
        if p is not None:
            grads = [
                _reduce_to(gy * yhat, self.num_channels, self._sum_dims),
                _reduce_to(gy, self.num_channels, self._sum_dims),
            ]
            gyhat = gy * p[0]
        else:
            gyhat = gy
        gx = None
        if need_gx:
            # the CPU kernel reads these as contiguous whatever their strides (ring buffer rows)
            gx = aten.native_group_norm_backward(
                gyhat.contiguous(), x.contiguous(), mean.contiguous(), rstd.contiguous(), None,
                x.shape[0] * x.shape[1], self.num_channels, self._spatial, self.num_groups,
                [True, False, False],
            )[0]
        return gx, grads


class LayerNorm(Kernel):
    """LayerNorm over the trailing ``normalized_shape`` dimensions, per-member affine."""

    num_saved = 4

    def __init__(self, normalized_shape: Shape, eps: float, weight: bool, bias: bool) -> None:
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.has_weight = weight
        self.has_bias = bias
        params: list[tuple[str, Shape]] = []
        if weight:
            params.append(("weight", self.normalized_shape))
        if bias:
            params.append(("bias", self.normalized_shape))
        self.params = tuple(params)

    def _config(self) -> tuple:
        return (self.normalized_shape, self.eps, self.has_weight, self.has_bias)

    def _bind(self, in_shape: Shape) -> Shape:
        k = len(self.normalized_shape)
        if tuple(in_shape[len(in_shape) - k :]) != self.normalized_shape:
            raise PipetrainError(f"LayerNorm{self.normalized_shape} got input {in_shape}")
        self._lead = len(in_shape) - k  # per-sample dims before the normalised ones
        self._sum_dims = tuple(range(1, 2 + self._lead))
        self._numel = math.prod(self.normalized_shape)
        return in_shape

    def _view(self, t: Tensor) -> Tensor:
        return t.view((t.shape[0],) + (1,) * (1 + self._lead) + self.normalized_shape)

    def prepare(self, p):
        weight = self._view(p[0]) if self.has_weight else None
        bias = self._view(p[1 if self.has_weight else 0]) if self.has_bias else None
        return (weight, bias)

    def forward(self, p, x):
        weight, bias = p
        yhat, mean, rstd = torch.native_layer_norm(x, self.normalized_shape, None, None, self.eps)
        if weight is not None and bias is not None:
            y = torch.addcmul(bias, yhat, weight)
        elif weight is not None:
            y = yhat * weight
        elif bias is not None:
            y = yhat + bias
        else:
            y = yhat
        return y, [x, mean, rstd, yhat]

    def backward(self, p, saved, gy, need_gx):
        x, mean, rstd, yhat = saved
        g = gy.shape[0]
        grads: list[Tensor | Outer] = []
        gyhat = gy
        if self.has_weight:
            grads.append(_reduce_to(gy * yhat, self._numel, self._sum_dims).view((g,) + self.normalized_shape))
            gyhat = gy * p[0]
        if self.has_bias:
            grads.append(_reduce_to(gy, self._numel, self._sum_dims).view((g,) + self.normalized_shape))
        gx = None
        if need_gx:
            gx = aten.native_layer_norm_backward(
                gyhat.contiguous(), x.contiguous(), self.normalized_shape, mean.contiguous(),
                rstd.contiguous(), None, None, [True, False, False],
            )[0]
        return gx, grads


class Activation(Kernel):
    """Elementwise ``relu``, ``gelu`` (exact or tanh), ``tanh`` or ``sigmoid``."""

    def __init__(self, kind: str, approximate: str = "none") -> None:
        if kind not in ("relu", "gelu", "tanh", "sigmoid"):
            raise PipetrainError(f"unknown activation {kind!r}")
        self.kind = kind
        self.approximate = approximate
        self.num_saved = 2 if kind == "gelu" and approximate == "none" else 1

    def _config(self) -> tuple:
        return (self.kind, self.approximate)

    def prepare(self, p):
        return None

    def forward(self, p, x):
        kind = self.kind
        if kind == "relu":
            y = torch.relu(x)
            return y, [y]
        if kind == "gelu":
            if self.approximate != "none":
                return aten.gelu(x, approximate=self.approximate), [x]
            # x * Phi(x) with Phi(x) = (1 + erf(x / sqrt 2)) / 2: a few cheap elementwise ops are
            # faster than aten.gelu's fixed cost on small tensors; Phi is kept for the backward
            dtype = x.dtype
            phi = torch.erf(x * _constant(0.7071067811865476, dtype))
            phi.add_(_constant(1.0, dtype)).mul_(_constant(0.5, dtype))
            return x * phi, [x, phi]
        y = torch.tanh(x) if kind == "tanh" else torch.sigmoid(x)
        return y, [y]

    def backward(self, p, saved, gy, need_gx):
        if not need_gx:
            return None, []
        kind = self.kind
        if kind == "relu":
            return aten.threshold_backward(gy, saved[0], 0), []
        if kind == "gelu":
            if self.approximate != "none":
                return aten.gelu_backward(gy, saved[0], approximate=self.approximate), []
            # d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
            x, phi = saved
            dtype = x.dtype
            density = torch.exp(x * x * _constant(-0.5, dtype))
            density.mul_(x).mul_(_constant(0.3989422804014327, dtype)).add_(phi)
            return gy * density, []
        if kind == "tanh":
            return aten.tanh_backward(gy, saved[0]), []
        return aten.sigmoid_backward(gy, saved[0]), []


class Reshape(Kernel):
    """Identity, Flatten and Unflatten: a change of the per-sample shape, nothing saved."""

    def __init__(self, kind: str, start: int = 1, end: int = -1, sizes: Shape = ()) -> None:
        self.kind = kind
        self.start = start
        self.end = end
        self.sizes = tuple(sizes)

    def _config(self) -> tuple:
        return (self.kind, self.start, self.end, self.sizes)

    def _bind(self, in_shape: Shape) -> Shape:
        if self.kind == "identity":
            return in_shape
        probe = torch.empty((1,) + tuple(in_shape), device="meta")
        if self.kind == "flatten":
            return tuple(probe.flatten(self.start, self.end).shape[1:])
        return tuple(probe.unflatten(self.start, self.sizes).shape[1:])

    def prepare(self, p):
        return None

    def forward(self, p, x):
        if self.kind == "identity":
            return x, []
        return x.reshape(x.shape[:2] + self.out_shape), []

    def backward(self, p, saved, gy, need_gx):
        if not need_gx:
            return None, []
        if self.kind == "identity":
            return gy, []
        return gy.reshape(gy.shape[:2] + self.in_shape), []


class Conv2d(Kernel):
    """2-d convolution, zero padding, computed one of two ways (the same for a given shape):

    * a matrix product per member: the input's patches (``unfold``, ``[G, C*k*k, B*L]`` for L
      output pixels) times the ``[G, out, C*k*k]`` weights, one ``bmm`` for all G members; the
      weight gradient comes back as an :class:`Outer`, the input gradient is the patches'
      gradient added back (``index_add_``);
    * one convolution with G groups (oneDNN), the members side by side on the channels.

    The grouped convolution pays a large fixed cost per call and is slow on small images, the
    patches grow with the image and stop fitting in cache: measured on one core (fwd+bwd, 3x3,
    batch 1), 3 members 16x8x8: patches 140 us, grouped 253 us; 48 members 16x8x8: 4.4 ms
    against 0.9 ms; 48 members 64x2x2: 2.5 ms against 9.0 ms. So: grouped from
    :data:`GROUPED_MIN_PIXELS` output pixels and :data:`GROUPED_MIN_SAMPLES` members x samples
    on, patches below (and grouped for channel groups, always).
    """

    GROUPED_MIN_PIXELS = 64
    GROUPED_MIN_SAMPLES = 8

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias):
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = tuple(kernel_size)
        self.stride = tuple(stride)
        self.padding = tuple(padding)
        self.dilation = tuple(dilation)
        self.groups = groups
        self.bias = bias
        params: list[tuple[str, Shape]] = [
            ("weight", (out_channels, in_channels // groups) + self.kernel_size)
        ]
        if bias:
            params.append(("bias", (out_channels,)))
        self.params = tuple(params)
        self.num_saved = 1

    def _config(self) -> tuple:
        return (self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                self.dilation, self.groups, self.bias)

    def _bind(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 3 or in_shape[0] != self.in_channels:
            raise PipetrainError(f"Conv2d({self.in_channels}, ...) needs (C, H, W) input, got {in_shape}")
        out = []
        for size, k, s, pad, d in zip(in_shape[1:], self.kernel_size, self.stride, self.padding, self.dilation):
            out.append((size + 2 * pad - d * (k - 1) - 1) // s + 1)
        self._pixels = out[0] * out[1]
        self._patch = self.in_channels * math.prod(self.kernel_size)
        self._index = self._patch_index(in_shape[1:], out)
        return (self.out_channels, out[0], out[1])

    def _patch_index(self, size: Sequence[int], out: Sequence[int]) -> Tensor:
        """``[k*k*L]``: the input pixel (``H*W`` for the zero padding) of every patch entry, in
        ``unfold``'s order, for the input gradient (``index_add_``, faster than ``fold`` here)."""
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        h = torch.arange(out[0]).view(1, 1, -1, 1) * sh - ph + torch.arange(kh).view(-1, 1, 1, 1) * dh
        w = torch.arange(out[1]).view(1, 1, 1, -1) * sw - pw + torch.arange(kw).view(1, -1, 1, 1) * dw
        inside = (h >= 0) & (h < size[0]) & (w >= 0) & (w < size[1])
        return torch.where(inside, h * size[1] + w, size[0] * size[1]).reshape(-1)

    # -- grouped convolution (channel groups) ---------------------------------------------------

    def _stack(self, x: Tensor) -> Tensor:
        g, b = x.shape[0], x.shape[1]
        if b != 1:
            x = x.transpose(0, 1)
        return x.reshape((b, g * x.shape[2]) + tuple(x.shape[3:]))

    def _unstack(self, y: Tensor, g: int, channels: int) -> Tensor:
        b = y.shape[0]
        y = y.view((b, g, channels) + tuple(y.shape[2:]))
        return y.view((g, 1) + tuple(y.shape[2:])) if b == 1 else y.transpose(0, 1)

    def prepare(self, p):
        """``(weights, [G*out, C, k, k] and bias [G*out] for the grouped convolution,
        [G, out, C*k*k] and bias [G, out, 1] for the matrix product)``, all views."""
        g = p[0].shape[0]
        weight = p[0].reshape((g * self.out_channels,) + tuple(p[0].shape[2:]))
        if weight.data_ptr() != p[0].data_ptr() or not p[0].is_contiguous():
            raise PipetrainError("Conv2d kernel needs each member's weights contiguous")
        bias = p[1].reshape(g * self.out_channels) if self.bias else None
        matrix = p[0].view(g, self.out_channels, -1) if self.groups == 1 else None
        return (p[0], weight, bias, matrix, p[1].unsqueeze(2) if self.bias else None)

    def _grouped(self, g: int, b: int) -> bool:
        return self.groups != 1 or (self._pixels >= self.GROUPED_MIN_PIXELS and g * b >= self.GROUPED_MIN_SAMPLES)

    # -- patches ----------------------------------------------------------------------------------

    def _patches(self, x: Tensor) -> Tensor:
        """``[G, C*k*k, B*L]``: every output pixel's input patch, one column each."""
        g, b = x.shape[0], x.shape[1]
        cols = torch.nn.functional.unfold(
            x.reshape((g * b,) + self.in_shape), self.kernel_size, self.dilation, self.padding, self.stride
        )
        if b == 1:
            return cols.view(g, self._patch, self._pixels)
        return cols.view(g, b, self._patch, self._pixels).transpose(1, 2).reshape(g, self._patch, b * self._pixels)

    def _rows(self, t: Tensor, channels: int, b: int) -> Tensor:
        """``[G, B, C, H, W]`` -> ``[G, C, B*H*W]``."""
        g = t.shape[0]
        if b == 1:
            return t.reshape(g, channels, -1)
        return t.reshape(g, b, channels, -1).transpose(1, 2).reshape(g, channels, -1)

    def forward(self, p, x):
        g, b = x.shape[0], x.shape[1]
        if self._grouped(g, b):
            xs = self._stack(x)
            y = torch.conv2d(xs, p[1], p[2], self.stride, self.padding, self.dilation, g * self.groups)
            return self._unstack(y, g, self.out_channels), [x]
        cols = self._patches(x)
        y = torch.baddbmm(p[4], p[3], cols) if p[4] is not None else torch.bmm(p[3], cols)
        if b == 1:
            return y.view((g, 1) + self.out_shape), [cols]
        return y.view((g, self.out_channels, b) + self.out_shape[1:]).transpose(1, 2), [cols]

    def backward(self, p, saved, gy, need_gx):
        g, b = gy.shape[0], gy.shape[1]
        if self._grouped(g, b):
            return self._grouped_backward(p, saved, gy, need_gx)
        cols = saved[0]
        gy2 = self._rows(gy, self.out_channels, b)  # [G, out, B*L]
        grads: list[Tensor | Outer] = [Outer(gy2, cols.transpose(1, 2), (g,) + self.params[0][1])]
        if self.bias:
            grads.append(gy2.sum(2))
        gx = None
        if need_gx:
            gcols = torch.bmm(p[3].transpose(1, 2), gy2)  # [G, C*k*k, B*L]
            if b != 1:
                gcols = gcols.view(g, self._patch, b, self._pixels).transpose(1, 2)
            c, pixels = self.in_channels, self.in_shape[1] * self.in_shape[2]
            padded = gcols.new_zeros((g * b, c, pixels + 1))
            padded.index_add_(2, self._index, gcols.reshape(g * b, c, -1))
            gx = padded[:, :, :pixels].view((g, b) + self.in_shape)
        return gx, grads

    def _grouped_backward(self, p, saved, gy, need_gx):
        xs = self._stack(saved[0])
        g = gy.shape[0]
        w = p[1]
        gys = self._stack(gy)
        gx, gw, gb = aten.convolution_backward(
            gys, xs, w, [g * self.out_channels] if self.bias else None, list(self.stride),
            list(self.padding), list(self.dilation), False, [0, 0], g * self.groups,
            [need_gx, True, self.bias],
        )
        grads: list[Tensor | Outer] = [gw.view((g,) + tuple(p[0].shape[1:]))]
        if self.bias:
            grads.append(gb.view(g, self.out_channels))
        return (self._unstack(gx, g, self.in_channels) if need_gx else None), grads


class GlobalAvgPool(Kernel):
    """``AdaptiveAvgPool2d(1)``: the mean over the spatial dimensions, kept as size 1."""

    def _bind(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 3:
            raise PipetrainError(f"AdaptiveAvgPool2d(1) needs (C, H, W) input, got {in_shape}")
        self._count = in_shape[1] * in_shape[2]
        return (in_shape[0], 1, 1)

    def prepare(self, p):
        return None

    def forward(self, p, x):
        return x.mean((-2, -1), keepdim=True), []

    def backward(self, p, saved, gy, need_gx):
        if not need_gx:
            return None, []
        return gy.expand(gy.shape[:3] + self.in_shape[1:]) / self._count, []
