"""Outputs every executor writes the same way: held-out batches, the saved model, progress."""

from __future__ import annotations

import os
from typing import Any

import torch

from pipetrain.training.setup import Run

__all__ = ["eval_batches", "save_state_dict", "Progress"]


def eval_batches(run: Run, batch_size: int | None = None) -> list[tuple[Any, torch.Tensor]]:
    """The held-out set in fixed batches (no shuffling), in the run's dtype."""
    from pipetrain.data import get_batch

    if run.test_set is None or len(run.test_set) == 0:
        return []
    size = batch_size or max(run.layout.batch_size, 64)
    batches = []
    for start in range(0, len(run.test_set), size):
        x, y = get_batch(run.test_set, torch.arange(start, min(start + size, len(run.test_set))))
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(run.dtype)
        batches.append((x, y))
    return batches


def save_state_dict(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save`` to a temporary name, then rename: a crash never leaves a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({k: v.detach().clone() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


class Progress:
    """A progress bar over updates showing the loss and samples/s (silent when disabled)."""

    def __init__(self, total: int, enabled: bool, description: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=description, unit="step", dynamic_ncols=True, leave=True)
        self.samples = 0

    def update(self, steps: int, loss: float, samples: int, seconds: float) -> None:
        self.samples += samples
        if self.bar is not None:
            rate = self.samples / seconds if seconds > 0 else 0.0
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}", refresh=False)
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
