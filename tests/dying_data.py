"""A plain data set (read in DataLoader worker processes) whose worker process kills itself
with SIGKILL after reading ``die_after`` samples, on the first start of the workers only: a real
death of a data worker at a chosen point, the process the kernel's out-of-memory killer usually
picks. Started again (``PIPETRAIN_RESTART`` above 0), and in the emulator, it reads normally.
``--data dying_data:make:die_after=120`` (tests/ on the path)."""

from __future__ import annotations

import os
import signal

import torch
from torch.utils.data import Dataset, get_worker_info


class Points(Dataset):
    """Random points of 3 classes, each read with a little noise of its sample's seed."""

    def __init__(self, samples: int = 96, split: str = "train", die_after: int = 0) -> None:
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.x = torch.randn(samples, 8, generator=g)
        self.y = torch.randint(0, 3, (samples,), generator=g)
        self.die_after = die_after
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.die_after and get_worker_info() is not None and os.environ.get("PIPETRAIN_RESTART") == "0":
            self.reads += 1
            if self.reads == self.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i] * (1 + 0.01 * torch.rand(())), int(self.y[i])


def make(samples: int = 96, split: str = "train", die_after: int = 0) -> Points:
    return Points(samples, split, die_after if split == "train" else 0)
