"""A model whose held-out forward is long work: a module that, in eval mode, sleeps ``seconds``
(after touching the file named by ``$SLOW_EVAL_MARK``, when set), as a large model's evaluation
computes for minutes on a small machine. Training and the checks on the meta device run at full
speed. ``--model slow_eval:make:seconds=6 --balance 2,2`` puts it on stage 0 (tests/ on the path)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class SlowWhenEvaluating(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and x.device.type != "meta":
            mark = os.environ.get("SLOW_EVAL_MARK")
            if mark:
                with open(mark, "a"):
                    pass
            time.sleep(self.seconds)
        return x


def make(in_features: int, num_classes: int, seconds: float = 6.0) -> list[nn.Module]:
    return [nn.Linear(in_features, 16), SlowWhenEvaluating(seconds), nn.ReLU(), nn.Linear(16, num_classes)]
