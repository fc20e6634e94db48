"""The autograd leaves a forward reads, on their own: shared per version, fresh for given or
predicted weights, dropped with their version."""

from __future__ import annotations

import torch

from pipetrain.execution.leaves import ForwardLeaves
from pipetrain.execution.version_store import VersionStore
from pipetrain.optim import SGD


def _store() -> VersionStore:
    return VersionStore({"w": torch.ones(2, 2), "frozen": torch.zeros(2)})


def test_one_set_of_leaves_per_version_only_the_trainable_take_a_gradient():
    versions, leaves = _store(), ForwardLeaves(frozenset({"w"}))
    first = leaves.of_version(versions, 0)
    assert leaves.of_version(versions, 0) is first
    assert first["w"].requires_grad and not first["frozen"].requires_grad
    assert first["w"].data_ptr() == versions[0]["w"].data_ptr()  # a leaf of the version's tensor, no copy
    own = leaves.make(versions[0])
    assert own["w"] is not first["w"] and own["w"].requires_grad


def test_a_versions_leaves_go_once_the_store_drops_it():
    versions, leaves = _store(), ForwardLeaves(frozenset({"w"}))
    leaves.of_version(versions, 0)
    versions.push({"w": torch.full((2, 2), 2.0), "frozen": torch.zeros(2)})
    leaves.forget(versions, 0)
    assert 0 in leaves.by_version  # still held
    versions.release(0)
    leaves.forget(versions, 0)
    assert 0 not in leaves.by_version


def test_a_prediction_writes_into_the_tensors_of_one_whose_backward_has_run():
    versions, leaves = _store(), ForwardLeaves(frozenset({"w"}))
    optimizer = SGD(lr=0.1, momentum=0.9, lwp_horizon=2.0)
    weights = versions[0]
    # a momentum step first, so that the prediction moves the weights (and writes new tensors)
    optimizer.step(weights, {"w": torch.ones(2, 2), "frozen": None}, 0, out={})
    made, predicted = leaves.predicted(weights, optimizer, 1)
    assert list(predicted) == ["w"] and made["w"].data_ptr() == predicted["w"].data_ptr()
    assert not torch.equal(made["w"], weights["w"])
    leaves.free(predicted)
    again, reused = leaves.predicted(weights, optimizer, 1)
    assert reused["w"] is predicted["w"] and torch.equal(again["w"], made["w"])
    leaves.free(None)  # nothing predicted: nothing to free


def test_a_forward_reads_given_weights_a_prediction_or_the_shared_set():
    versions, leaves = _store(), ForwardLeaves(frozenset({"w"}))
    shared, none = leaves.read(versions, 0, None, False, None, 0)
    assert none is None and shared is leaves.of_version(versions, 0)
    given = {"w": torch.full((2, 2), 3.0), "frozen": torch.zeros(2)}
    own, _ = leaves.read(versions, 0, given, True, SGD(lr=0.1), 0)
    assert own["w"].data_ptr() == given["w"].data_ptr() and own["w"] is not shared["w"]
    unpredicted, _ = leaves.read(versions, 0, None, True, None, 0)  # predict without an optimizer: its own set
    assert unpredicted["w"] is not shared["w"] and torch.equal(unpredicted["w"], shared["w"])
