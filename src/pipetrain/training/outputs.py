"""Outputs every executor writes the same way: held-out batches, the saved model, progress."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from pipetrain.training.setup import Run

__all__ = ["EvalBatches", "eval_batches", "save_state_dict", "Progress", "UpdateLosses"]


class EvalBatches:
    """The held-out set in fixed batches (no shuffling), in the run's dtype, read on demand: every
    rank knows how many there are, only the rank that holds stage 0 reads them."""

    def __init__(self, run: Run, batch_size: int | None = None) -> None:
        self.dataset = run.test_set
        self.dtype = run.dtype
        self.seed = run.config.seed
        self.size = batch_size or max(run.layout.batch_size, 64)
        self.total = 0 if self.dataset is None else len(self.dataset)
        if run.config.eval_samples is not None:
            self.total = min(self.total, run.config.eval_samples)

    def __len__(self) -> int:
        return -(-self.total // self.size)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        from pipetrain.data import data_seed, get_batch, seeded

        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.size
        with seeded(data_seed(self.seed, index, stream=2)):  # a held-out set that augments reads the same everywhere
            x, y = get_batch(self.dataset, torch.arange(start, min(start + self.size, self.total)))
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(self.dtype)
        return x, y


def eval_batches(run: Run, batch_size: int | None = None) -> EvalBatches:
    return EvalBatches(run, batch_size)


def save_state_dict(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save`` to a temporary name, then rename: a crash never leaves a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({k: v.detach().clone() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


class UpdateLosses:
    """Collects the losses of units as the last stage computes them and turns each completed
    update's units into that update's loss (their mean losses weighted by sample share)."""

    def __init__(self, run: Run, progress: "Progress | None" = None, rank: int | None = None) -> None:
        self.layout = run.layout
        self.units = run.layout.units_per_update
        self.progress = progress
        # on a replicated last stage a rank sees only its replica's units
        last = run.schedule.num_stages - 1
        self._mine = (lambda unit: True) if rank is None else (lambda unit: run.schedule.rank_of(last, unit) == rank)
        self.losses: list[float] = []
        self._pending: dict[int, float] = {}
        self._expected: dict[int, list[int]] = {}  # first unit of an update -> its units seen here
        self._started = time.perf_counter()

    def __call__(self, unit: int, loss: float) -> None:
        self._pending[unit] = loss * self.layout.loss_scale(unit)
        first = unit // self.units * self.units
        expected = self._expected.get(first)
        if expected is None:  # once per update, not per unit
            expected = self._expected[first] = [u for u in range(first, first + self.units) if self._mine(u)]
        if all(u in self._pending for u in expected):
            del self._expected[first]
            self.losses.append(sum(self._pending.pop(u) for u in expected))
            if self.progress is not None:
                self.progress.update(1, self.losses[-1], self.layout.batch_size, time.perf_counter() - self._started)

    @staticmethod
    def from_units(run: Run, losses: dict[int, float]) -> list[float]:
        """Per-update losses from a complete ``{unit: loss}`` record."""
        units, layout = run.layout.units_per_update, run.layout
        return [sum(losses[k] * layout.loss_scale(k) for k in range(t * units, (t + 1) * units))
                for t in range(run.updates)]


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
