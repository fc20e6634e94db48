"""The wire format of a message: header words, tensor layout, packing and zero-copy unpacking.

A data message is int64 header words, then the tensors, each padded to 16 bytes::

    MAGIC|DATA  seq  total_bytes  header_words  tag  n_info  info[0..3]  form  n_tensors
    (dtype_code  ndim  dim_0 .. dim_ndim-1) per tensor   [structure]   [0 to make the header 16-byte aligned]
    tensor 0 bytes [pad] tensor 1 bytes [pad] ...

``form`` is :data:`SINGLE` (one tensor), :data:`TUPLE` (a flat tuple of tensors) or
:data:`STRUCTURED`: any other nesting of tuples, lists and dicts of tensors, whose
:class:`~pipetrain.structure.Structure` text follows the tensor descriptions (its byte count, then
its UTF-8 bytes in int64 words), so that the receiver rebuilds exactly what was sent. The first two
carry no structure and cost nothing extra.

A control message (``MAGIC|CONTROL seq next_total next_header_words``) announces the size of the
next message. See :class:`pipetrain.runtime.p2p.Messenger`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from pipetrain.errors import PipetrainError

__all__: list[str] = []

#: How many user integers (``info=``) a message can carry besides its ``tag``.
MAX_INFO = 4

MAGIC = 0x5049504554524E00  # "PIPETRN\0"
DATA = MAGIC | 1
CONTROL = MAGIC | 2
PREFIX = 6 + MAX_INFO  # header words before the payload description (form, count, tensors)
INITIAL_TOTAL = 64  # bytes the receiver expects before the first message of a channel
INITIAL_WORDS = 4  # header words the receiver reads from that first (control) message
ALIGN = 16
#: The ``form`` word of a payload.
SINGLE, TUPLE, STRUCTURED = 0, 1, 2

# Wire codes of dtypes. Append only: the code is the index.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
# On CPU, packing and unpacking go through numpy views: a numpy call costs about a microsecond, a
# torch call several, and a small message is all overhead. bfloat16 (no numpy type) uses torch.
NUMPY: dict[torch.dtype, Any] = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}  # fmt: skip
CPU = torch.device("cpu")

# (dtype, shape, byte offset in the message, byte count, numpy dtype or None) per tensor
Layout = list[tuple[torch.dtype, tuple[int, ...], int, int, Any]]


def padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def meta_words(tensors: Sequence[torch.Tensor], single: bool, structure: str | None = None) -> list[int]:
    """The payload description words (form, count, then dtype code, ndim and dims per tensor, then
    a structured payload's structure text), padded to an even header length."""
    words = [STRUCTURED if structure is not None else SINGLE if single else TUPLE, len(tensors)]
    for t in tensors:
        code = DTYPE_CODE.get(t.dtype)
        if code is None:
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise PipetrainError(f"cannot send a tensor of dtype {t.dtype}; supported: {supported}")
        words.append(code)
        words.append(t.dim())
        words.extend(t.shape)
    if structure is not None:
        data = structure.encode()
        words.append(len(data))
        words.extend(np.frombuffer(data + bytes(-len(data) % 8), dtype=np.int64).tolist())
    if (PREFIX + len(words)) % 2:
        words.append(0)
    return words


def parse_meta(words: list[int]) -> tuple[int, str | None, Layout]:
    """Payload description words -> (form, structure text or None, layout)."""
    form = words[0]
    count = words[1]
    offset = (PREFIX + len(words)) * 8
    layout: Layout = []
    i = 2
    for _ in range(count):
        dtype = DTYPES[words[i]]
        ndim = words[i + 1]
        shape = tuple(words[i + 2 : i + 2 + ndim])
        i += 2 + ndim
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        layout.append((dtype, shape, offset, nbytes, NUMPY.get(dtype)))
        offset += padded(nbytes)
    structure = None
    if form == STRUCTURED:
        size = words[i]
        structure = np.array(words[i + 1 : i + 1 + -(-size // 8)], dtype=np.int64).tobytes()[:size].decode()
    return form, structure, layout


ZEROS = [0] * MAX_INFO


def pack(
    header: list[int], tensors: Sequence[torch.Tensor], layout: Layout, total: int, device: torch.device
) -> torch.Tensor:
    """One message: the header words, then each tensor's bytes at its offset (padding left as is)."""
    message = torch.empty(total, dtype=torch.uint8, device=device)
    if device == CPU:
        array = message.numpy()
        array[: len(header) * 8].view(np.int64)[:] = header
        for t, (dtype, shape, offset, nbytes, np_dtype) in zip(tensors, layout):
            if not nbytes:
                continue
            src = t.detach()
            if src.device != CPU:  # a stage on an accelerator, messages through host memory
                src = src.cpu()
            if np_dtype is not None:
                if src.is_complex():
                    src = src.resolve_conj().resolve_neg()
                array[offset : offset + nbytes].view(np_dtype).reshape(shape)[...] = src.numpy()
            else:
                message[offset : offset + nbytes].view(dtype).view(shape).copy_(src)
        return message
    message[: len(header) * 8].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    for t, (dtype, shape, offset, nbytes, _) in zip(tensors, layout):
        if nbytes:
            message[offset : offset + nbytes].view(dtype).view(shape).copy_(t.detach())
    return message


def header_words(buffer: torch.Tensor, array: Any, words: int) -> list[int]:
    """The first ``words`` int64 words of a received message (through numpy on CPU)."""
    if array is not None:
        return array[: words * 8].view(np.int64).tolist()
    return buffer[: words * 8].view(torch.int64).tolist()


def unpack(buffer: torch.Tensor, array: Any, layout: Layout) -> tuple[torch.Tensor, ...]:
    """Views of the received message, one per tensor (no copy)."""
    if array is not None:
        return tuple(
            torch.from_numpy(array[offset : offset + nbytes].view(np_dtype).reshape(shape))
            if np_dtype is not None
            else buffer[offset : offset + nbytes].view(dtype).view(shape)
            for dtype, shape, offset, nbytes, np_dtype in layout
        )
    return tuple(
        buffer[offset : offset + nbytes].view(dtype).view(shape) for dtype, shape, offset, nbytes, _ in layout
    )


