"""Where a run computes: the ``--device`` choice, and values moved to a stage's device.

Nothing below the set-up names a device: a stage computes where its parameters are
(:attr:`~pipetrain.execution.StageExecutor.device`) and moves what arrives (a batch read on the
CPU, a message, labels, a checkpoint's tensors) there with :func:`to_device`; versions, gradients
and optimizer state are made from the parameters, so they live there too.

Mixed precision (``autocast=torch.bfloat16``): every forward (and the loss) runs under
``torch.autocast`` on the stage's device (:func:`autocast_on`); weights, versions, gradients and
optimizer state stay in the module's own (master) dtype, and activations and their gradients travel
in the dtype autocast gives them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import Tensor

from pipetrain.errors import ConfigError, option
from pipetrain.structure import map_values

__all__ = ["DEVICES", "resolve_device", "to_device", "autocast_on"]

#: ``--device``: ``auto`` is CUDA when available, else the CPU
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The device of ``--device name`` for this process: on CUDA, GPU ``local_rank`` (default:
    the environment's ``LOCAL_RANK``, as torchrun and pipetrain's launcher set it, else the
    current GPU). ``--device cuda`` where CUDA is not available is a :class:`ConfigError`."""
    if name not in DEVICES:
        raise ConfigError(f"unknown {option('device')} {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{option('device', 'cuda')}: CUDA is not available here (torch.cuda.is_available() is False: no GPU, "
            f"no driver, or a CPU-only PyTorch); use {option('device', 'cpu')}, or {option('device', 'auto')} to "
            "take a GPU only where there is one"
        )
    if local_rank is None:
        local = os.environ.get("LOCAL_RANK")
        local_rank = int(local) if local else torch.cuda.current_device()
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count)  # more ranks than GPUs share them


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them, anything else as it is) with every
    tensor on ``device``; tensors already there are returned as they are (no copy)."""
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device, non_blocking=non_blocking)
    if type(value) is tuple and all(isinstance(t, Tensor) and t.device == device for t in value):
        return value  # the common case, a stage's inputs already there: nothing to build

    def move(t: Tensor) -> Tensor:
        return t if t.device == device else t.to(device, non_blocking=non_blocking)

    return map_values(value, move)


def autocast_on(device: torch.device, dtype: torch.dtype | None) -> Any:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; nothing when ``dtype`` is ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
