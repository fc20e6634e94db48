"""A stage's snapshot and its restore, on a stage executor driven action by action: what it keeps,
and that a restored stage continues bitwise as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.execution import StageExecutor
from pipetrain.optim import SGD


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(count)]


def _pipedream(interrupt: bool, recompute: bool = False) -> StageExecutor:
    """PipeDream's order on one stage (forward 1 before backward 0, weight stashing), with a
    checkpoint after the first update while microbatch 1 is in flight; restored into a new stage."""
    def stage():
        return StageExecutor(0, _batchnorm_model(), SGD(lr=0.1, momentum=0.9), loss_fn=F.cross_entropy,
                             recompute=recompute)

    batches = _batches(4)
    executor = stage()
    for microbatch in (0, 1):
        executor.forward(microbatch, 0, batches[microbatch][0], target=batches[microbatch][1], samples=8)
    executor.backward(0, 0)
    executor.step([])
    if interrupt:
        state = executor.snapshot()
        executor = stage()
        assert [microbatch for microbatch, _, _ in executor.restore(state)] == [1]
    for microbatch in (2, 3):
        version = microbatch - 1
        executor.forward(microbatch, version, batches[microbatch][0], target=batches[microbatch][1], samples=8)
        executor.backward(microbatch - 1, version - 1)
        executor.step([version - 1])
    return executor


@pytest.mark.parametrize("recompute", [False, True])
def test_a_batchnorm_stage_restored_with_a_microbatch_in_flight_continues_as_the_uninterrupted_one(recompute):
    # the replayed forward's graph saves the running statistics; copying the checkpoint's statistics
    # into them after the replay made the backward fail (a tensor it needs modified in place)
    kept, resumed = _pipedream(False, recompute), _pipedream(True, recompute)
    for name, value in kept.versions.latest.items():
        assert torch.equal(value, resumed.versions.latest[name]), name
    for name, value in kept.buffers.items():
        assert torch.equal(value, resumed.buffers[name]), name
