"""StageExecutor: gradient accumulation inside autograd and updates in place of a released version."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.execution import StageExecutor
from pipetrain.optim import Adam, SGD


def _module(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(count)]


def test_backward_accumulates_exactly_what_separate_gradients_sum_to():
    module, batches = _module(), _batches(3)
    executor = StageExecutor(1, module, None, loss_fn=F.cross_entropy)
    input_grads = []
    for k, (x, y) in enumerate(batches):
        executor.forward(k, 0, x, target=y, loss_scale=1 / 3, samples=5)
        input_grads.append(executor.backward(k, 0)[0])

    reference = _module()
    params = dict(reference.named_parameters())
    expected = {name: None for name in params}
    for (x, y), got in zip(batches, input_grads):
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(reference(x), y) * (1 / 3)
        grads = torch.autograd.grad(loss, [x, *params.values()])
        assert torch.equal(got, grads[0])
        for name, grad in zip(params, grads[1:]):
            expected[name] = grad if expected[name] is None else expected[name].add_(grad)
    assert executor.pending_samples == 15
    # between backwards the running sums stay on the version's autograd leaves ...
    assert all(leaf.grad is not None for leaf in executor.leaves.by_version[0].values())
    for name, grad in expected.items():
        assert torch.equal(executor.grads[name], grad), name
    # ... and reading them takes them off
    assert all(leaf.grad is None for leaf in executor.leaves.by_version[0].values())


@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01), lambda: Adam(lr=0.01)])
def test_an_update_that_releases_the_current_version_is_made_in_place_with_the_same_bits(optimizer):
    in_place = StageExecutor(1, _module(), optimizer(), loss_fn=F.cross_entropy)
    copied = StageExecutor(1, _module(), optimizer(), loss_fn=F.cross_entropy)
    for step, (x, y) in enumerate(_batches(4)):
        for executor, release in ((in_place, [step]), (copied, [])):
            executor.forward(step, step, x, target=y, samples=5)
            executor.backward(step, step)
            before = {name: t.data_ptr() for name, t in executor.versions.latest.items()}
            executor.step(release)
            after = {name: t.data_ptr() for name, t in executor.versions.latest.items()}
            assert (after == before) == bool(release)
        for name, value in in_place.versions.latest.items():
            assert torch.equal(value, copied.versions.latest[name]), name


def test_a_version_still_read_is_never_overwritten():
    # PipeDream's stage 0 with warm-up 1: microbatch 1 reads version 0 after the update that
    # follows microbatch 0's backward.
    executor = StageExecutor(0, _module(), SGD(lr=0.1))
    batches = _batches(2)
    executor.forward(0, 0, batches[0][0], samples=5)
    executor.forward(1, 0, batches[1][0], samples=5)
    version0 = {name: t.clone() for name, t in executor.versions[0].items()}
    executor.backward(0, 0, (torch.ones(5, 3),))
    executor.step([])  # version 0 is still read by microbatch 1
    for name, value in executor.versions[0].items():
        assert torch.equal(value, version0[name]), name
    executor.backward(1, 0, (torch.ones(5, 3),))
    executor.step([0])
    assert executor.versions.held() == [1, 2]


# -- non-finite losses, gradients and weights ------------------------------------------------------


def test_a_nan_loss_stops_the_stage_naming_the_microbatch():
    from pipetrain.errors import NonFiniteError

    executor = StageExecutor(1, _module(), SGD(lr=0.1), loss_fn=F.cross_entropy)
    (x, y), = _batches(1)
    x[2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"the loss of microbatch 7 is nan \(its input from stage 0 already "
                                             r"holds nan\)") as caught:
        executor.forward(7, 0, x, target=y, samples=5)
    assert (caught.value.stage, caught.value.microbatch) == (1, 7)


def test_under_stop_a_gradient_that_is_not_finite_stops_at_the_next_loss_or_checkpoint():
    # stop tests no gradient (that would cost a pass over it per update): the weights it makes are
    # caught by the next loss computed through them, by a checkpoint, and at the end
    from pipetrain.errors import NonFiniteError

    executor = StageExecutor(1, _module(), SGD(lr=0.1), loss_fn=F.cross_entropy, nonfinite="stop")
    (x, y), = _batches(1)
    executor.forward(0, 0, x, target=y, samples=5)
    executor.backward(0, 0)
    executor.grads = {name: torch.full_like(g, float("inf")) for name, g in executor.grads.items()}
    executor.step([0])
    with pytest.raises(NonFiniteError, match=r"the weights after update 1 are not finite in .*; no checkpoint was "
                                             r"written") as caught:
        executor.snapshot()
    assert (caught.value.stage, caught.value.step) == (1, 1)
    with pytest.raises(NonFiniteError, match=r"the loss of microbatch 1 is nan \(the weights of this stage are not "
                                             r"finite in 0.weight \((nan|inf)\)"):
        executor.forward(1, 1, x, target=y, samples=5)


@pytest.mark.parametrize("release", [True, False])
def test_skip_keeps_the_weights_and_the_optimizer_state_of_an_update_whose_gradient_is_not_finite(release):
    # three updates, the second with an infinite output gradient: under skip the result equals
    # two updates on the first and third batches, the optimizer's momentum untouched in between
    skipping = StageExecutor(0, _module(), SGD(lr=0.1, momentum=0.9), nonfinite="skip")
    reference = StageExecutor(0, _module(), SGD(lr=0.1, momentum=0.9))
    batches = _batches(3)
    grad = (torch.ones(5, 3),)
    for step, (x, _) in enumerate(batches):
        skipping.forward(step, step, x, samples=5)
        skipping.backward(step, step, (torch.full((5, 3), float("nan")),) if step == 1 else grad)
        assert skipping.step([step] if release else []) == step + 1  # a skipped update still makes a version
    for step, (x, _) in enumerate([batches[0], batches[2]]):
        reference.forward(step, step, x, samples=5)
        reference.backward(step, step, grad)
        reference.step([step])
    assert skipping.skipped == [2]
    for name, value in skipping.versions.latest.items():
        assert torch.equal(value, reference.versions.latest[name]), name
    if not release:  # versions still held are never modified by a skip
        for name, value in skipping.versions[1].items():
            assert torch.equal(value, skipping.versions[2][name]), name
            assert value.data_ptr() != skipping.versions[2][name].data_ptr()


def test_skip_stops_after_too_many_updates_in_a_row():
    from pipetrain.errors import NonFiniteError
    from pipetrain.execution.nonfinite import SKIP_LIMIT

    executor = StageExecutor(0, _module(), SGD(lr=0.1), nonfinite="skip")
    (x, _), = _batches(1)
    with pytest.raises(NonFiniteError, match=f"updates 1 to {SKIP_LIMIT} were all not finite"):
        for step in range(SKIP_LIMIT + 1):
            executor.forward(step, step, x, samples=5)
            executor.backward(step, step, (torch.full((5, 3), float("nan")),))
            executor.step([step])
    assert executor.skipped == list(range(1, SKIP_LIMIT + 1))


def test_write_back_refuses_weights_that_are_not_finite():
    from pipetrain.errors import NonFiniteError

    module = _module()
    executor = StageExecutor(0, module, SGD(lr=1e38))
    (x, _), = _batches(1)
    executor.forward(0, 0, x, samples=5)
    executor.backward(0, 0, (torch.full((5, 3), 1e3),))  # finite, but lr * gradient overflows
    executor.step([0])
    original = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(NonFiniteError, match="the weights after update 1 are not finite"):
        executor.write_back()
    for name, param in module.named_parameters():
        assert torch.equal(param, original[name]), name


def test_all_finite_reads_once_and_is_not_fooled_by_an_overflowing_sum():
    from pipetrain.execution.nonfinite import all_finite

    big = torch.full((4,), 3e38)
    assert all_finite([big, big])  # the sum overflows to inf, every value is finite
    assert all_finite([])
    assert not all_finite([torch.ones(3), torch.tensor([1.0, float("-inf")])])
    assert not all_finite([torch.tensor([float("nan")], dtype=torch.float64)])


# -- structured inputs and outputs ---------------------------------------------------------------


class Embedder(nn.Module):
    """Called with keyword arguments (a dict input); returns a dict with a float constant in it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)

    def forward(self, ids, mask):
        h = self.embed(ids)
        scale = torch.ones(ids.shape[1])  # made from a shape: needs no gradient
        return {"h": h, "mask": mask, "extra": (h * 2, scale)}


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 3)

    def forward(self, h, mask, extra):
        doubled, scale = extra
        return self.out((h + doubled) * scale[:, None] * mask[..., None]).mean(1)


def test_structured_values_cross_with_gradients_for_the_floats_that_need_them():
    torch.manual_seed(0)
    first, second = Embedder(), Reader()
    ids, y = torch.randint(0, 7, (5, 6)), torch.randint(0, 3, (5,))
    mask = torch.rand(5, 6) > 0.3
    a = StageExecutor(0, first, None)
    b = StageExecutor(1, second, None, loss_fn=F.cross_entropy)
    out = a.forward(0, 0, {"ids": ids, "mask": mask})
    assert list(out) == ["h", "mask", "extra"] and isinstance(out["extra"], tuple) and torch.equal(out["mask"], mask)
    assert a.last_constants == 0b1000  # leaf 3 (scale) took no gradient; mask is no float
    b.forward(0, 0, out, target=y, constants=a.last_constants)
    record = b.in_flight[0]
    assert [x.requires_grad for x in record.inputs] == [True, False, True, False]
    grads = b.backward(0, 0)
    assert grads[1] is None and grads[3] is None and grads[0].shape == (5, 6, 4)
    a.backward(0, 0, grads)
    # the same numbers as one process
    ref_first, ref_second = Embedder(), Reader()
    ref_first.load_state_dict(first.state_dict())
    ref_second.load_state_dict(second.state_dict())
    F.cross_entropy(ref_second(**ref_first(ids, mask)), y).backward()
    assert torch.equal(a.grads["embed.weight"], ref_first.embed.weight.grad)
    assert torch.equal(b.grads["out.weight"], ref_second.out.weight.grad)


def test_a_snapshot_keeps_the_structure_of_the_inputs_in_flight():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 7, (5, 6)), torch.rand(5, 6) > 0.3
    a = StageExecutor(0, Embedder(), None)
    b = StageExecutor(1, Reader(), None, loss_fn=F.cross_entropy)
    out = a.forward(0, 0, {"ids": ids, "mask": mask})
    b.forward(0, 0, out, target=torch.zeros(5, dtype=torch.long), constants=a.last_constants)
    state = b.snapshot()
    assert state["in_flight"][0]["structure"] == '{"h":*,"mask":*,"extra":(*,*)}'
    assert state["in_flight"][0]["constants"] == 0b1000
    resumed = StageExecutor(1, Reader(), None, loss_fn=F.cross_entropy)
    replayed = resumed.restore(state)
    assert [(k, c) for k, _, c in replayed] == [(0, 0)]  # the last stage hands nothing on
    assert [x.requires_grad for x in resumed.in_flight[0].inputs] == [True, False, True, False]
    assert torch.equal(resumed.backward(0, 0)[0], b.backward(0, 0)[0])
