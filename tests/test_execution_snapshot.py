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


def test_a_microbatch_in_flight_is_kept_as_what_runs_its_forward_again():
    from pipetrain.execution.inflight import InFlight
    from pipetrain.execution.snapshot import in_flight_state, replay_arguments
    from pipetrain.execution.version_store import VersionStore
    from pipetrain.structure import flatten

    x, mask, ids = torch.ones(2, requires_grad=True), torch.ones(2), torch.tensor([3])
    leaves, structure = flatten({"x": x, "mask": mask, "ids": ids})
    prediction = {"w": torch.full((2,), 5.0)}
    record = InFlight(leaves, (), prediction, samples=4, version=1, target=torch.tensor([0]), loss_scale=0.5,
                      scale=256.0, structure=structure)
    state = in_flight_state(7, record, with_params=True)
    assert state["constants"] == sum(1 << i for i, leaf in enumerate(leaves) if leaf is mask)  # a float without grad
    assert not any(t.requires_grad for t in state["inputs"] if isinstance(t, torch.Tensor))
    versions = VersionStore({"w": torch.zeros(2), "b": torch.zeros(1)})
    versions.push({"w": torch.ones(2), "b": torch.ones(1)})
    (microbatch, version, inputs), kwargs = replay_arguments(state, versions, stamped=True)
    assert (microbatch, version, set(inputs)) == (7, 1, {"x", "mask", "ids"})
    assert torch.equal(kwargs["params"]["w"], prediction["w"]) and torch.equal(kwargs["params"]["b"], torch.ones(1))
    assert (kwargs["samples"], kwargs["loss_scale"], kwargs["stamp"], kwargs["constants"]) == (4, 0.5, 256.0,
                                                                                               state["constants"])
    assert replay_arguments(state, versions, stamped=False)[1]["stamp"] is None
    assert in_flight_state(7, record, with_params=False)["params"] is None


def test_a_snapshot_refuses_weights_that_are_not_finite_and_copies_what_training_changes():
    from pipetrain.errors import NonFiniteError

    executor = StageExecutor(0, _batchnorm_model(), SGD(lr=0.1), loss_fn=F.cross_entropy)
    (x, y), = _batches(1)
    executor.forward(0, 0, x, target=y, samples=8)
    executor.backward(0, 0)
    state = executor.snapshot()
    assert state["pending_samples"] == 8 and state["in_flight"] == [] and state["fp16"] is None
    for name, grad in executor.grads.items():  # copies: the next backward adds to the executor's own
        assert torch.equal(state["grads"][name], grad) and state["grads"][name] is not grad
    assert all(state["buffers"][n] is not b for n, b in executor.buffers.items())
    executor.versions.latest["0.weight"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="no checkpoint was written"):
        executor.snapshot()
