"""The weights an update makes, on their own: into the released version's tensors or spares,
skipped as the same tensors or a copy, the gradient scaled first."""

from __future__ import annotations

import torch

from pipetrain.execution.update import updated_weights
from pipetrain.execution.version_store import VersionStore
from pipetrain.optim import SGD


def _store() -> VersionStore:
    return VersionStore({"w": torch.ones(3), "b": torch.zeros(1)})


def _grads() -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), 2.0), "b": torch.ones(1)}


def test_an_update_in_place_writes_into_the_current_versions_tensors():
    versions = _store()
    current = dict(versions.latest)
    new = updated_weights(versions, _grads(), SGD(lr=0.5), skip=False, in_place=True, factor=1.0, samples_seen=0)
    assert new["w"] is current["w"] and torch.equal(new["w"], torch.zeros(3))
    assert torch.equal(new["b"], torch.full((1,), -0.5))


def test_an_update_that_keeps_the_current_version_writes_new_tensors_and_scales_the_gradient():
    versions = _store()
    grads = _grads()
    new = updated_weights(versions, grads, SGD(lr=0.5), skip=False, in_place=False, factor=0.25, samples_seen=0)
    assert new["w"] is not versions.latest["w"] and torch.equal(versions.latest["w"], torch.ones(3))
    assert torch.equal(grads["w"], torch.full((3,), 0.5))  # the sums are scaled in place
    assert torch.equal(new["w"], torch.full((3,), 0.75))


def test_a_skipped_update_is_the_same_tensors_when_released_else_a_copy():
    versions = _store()
    same = updated_weights(versions, _grads(), SGD(lr=0.5), skip=True, in_place=True, factor=1.0, samples_seen=0)
    assert all(same[n] is t for n, t in versions.latest.items())
    copy = updated_weights(versions, _grads(), SGD(lr=0.5), skip=True, in_place=False, factor=1.0, samples_seen=0)
    for name, tensor in versions.latest.items():
        assert torch.equal(copy[name], tensor) and copy[name].data_ptr() != tensor.data_ptr()
    kept = updated_weights(versions, _grads(), None, skip=False, in_place=False, factor=1.0, samples_seen=0)
    assert kept == versions.latest and kept is not versions.latest  # no optimizer: the weights again


def test_an_update_reuses_the_tensors_of_a_released_version():
    versions = _store()
    versions.push({"w": torch.full((3,), 4.0), "b": torch.ones(1)})
    released = dict(versions[0])
    versions.release(0)
    new = updated_weights(versions, _grads(), SGD(lr=0.5), skip=False, in_place=False, factor=1.0, samples_seen=0)
    assert {new["w"].data_ptr(), new["b"].data_ptr()} == {released["w"].data_ptr(), released["b"].data_ptr()}
    assert torch.equal(new["w"], torch.full((3,), 3.0))
