"""Asynchronous schedules on the emulator against closed forms (docs/design.md 3.2-3.5)."""

import copy

import pytest
import torch
import torch.nn as nn

from pipetrain import Pipeline
from pipetrain.emulate import Emulator
from pipetrain.execution import StageExecutor, UnitData, UnitLayout
from pipetrain.optim import SGD
from pipetrain.schedule import Schedule, add_communication, assign_versions, build, check
from pipetrain.schedule.stream import one_forward_one_backward
from pipetrain.schedule.flush import update_actions


def mse(output, target):
    return ((output - target) ** 2).mean()


def linear_stages(count, width=3, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(width, width, bias=False).double() for _ in range(count)]


def regression_batches(count, size=4, width=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=generator, dtype=torch.float64),
             torch.randn(size, width, generator=generator, dtype=torch.float64)) for _ in range(count)]


def versioned_reference(stages, batches, versions_of, lr, units_per_update=1):
    """Plain SGD where unit k's forward and backward at stage s use weights ``versions_of(s, k)``
    and each update adds the gradients of ``units_per_update`` consecutive units to the latest
    weights (units are whole batches here)."""
    history = [[stage.weight.detach().clone()] for stage in stages]
    pending = [None] * len(stages)
    for k, (x, y) in enumerate(batches):
        weights = [history[s][versions_of(s, k)].clone().requires_grad_() for s in range(len(stages))]
        out = x
        for w in weights:
            out = out @ w.t()
        loss = mse(out, y) / units_per_update
        grads = torch.autograd.grad(loss, weights)
        for s, g in enumerate(grads):
            pending[s] = g if pending[s] is None else pending[s] + g
        if (k + 1) % units_per_update == 0:
            for s in range(len(stages)):
                history[s].append(torch.add(history[s][-1], pending[s], alpha=-lr))  # as SGD rounds
                pending[s] = None
    return [h[-1] for h in history]


def run_pipeline(stages, batches, schedule, policy=None, lr=0.1, microbatches=None):
    model_stages = [copy.deepcopy(s) for s in stages]
    pipe = Pipeline(model_stages, executor="emulate", schedule=schedule, policy=policy, loss_fn=mse,
                    optimizer=lambda stage, delay: SGD(lr=lr), microbatches=microbatches)
    pipe.train(batches)
    return [s.weight.detach() for s in model_stages]


def test_pipedream_two_stage_closed_form():
    """Stage 0 reads version k-1, stage 1 version k; the gradient goes to the latest weights."""
    stages, batches = linear_stages(2), regression_batches(10)
    expected = versioned_reference(stages, batches, lambda s, k: max(0, k - (1 - s)), lr=0.1)
    got = run_pipeline(stages, batches, "pipedream")
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("count", [3, 4])
def test_pipedream_closed_form_deeper(count):
    stages, batches = linear_stages(count), regression_batches(12)
    expected = versioned_reference(stages, batches, lambda s, k: max(0, k - (count - 1 - s)), lr=0.05)
    for g, e in zip(run_pipeline(stages, batches, "pipedream", lr=0.05), expected):
        assert torch.equal(g, e)


def test_pipedream_with_one_stage_is_plain_sgd():
    stages, batches = linear_stages(1), regression_batches(6)
    expected = versioned_reference(stages, batches, lambda s, k: k, lr=0.1)
    assert torch.equal(run_pipeline(stages, batches, "pipedream")[0], expected[0])


def test_zero_warmup_pipeline_is_plain_sgd():
    """A pipeline without pipelining (W = 0 everywhere) is plain SGD."""
    stages, batches = linear_stages(3), regression_batches(6)
    programs = [
        one_forward_one_backward(s, list(range(6)), 0, after_backward=lambda p, k, s=s: update_actions(s, False))
        for s in range(3)
    ]
    schedule = Schedule(programs, [[0], [1], [2]], name="custom", policy="stash", microbatches=6)
    schedule = add_communication(assign_versions(schedule))
    check(schedule)
    model_stages = [copy.deepcopy(s) for s in stages]
    executors = [{s: StageExecutor(s, model_stages[s], SGD(lr=0.1), loss_fn=mse if s == 2 else None)} for s in range(3)]
    data = UnitData(None, UnitLayout(4, 1), lambda t: t, lambda _d, t: batches[t])
    Emulator(schedule, executors, data).run()
    expected = versioned_reference(stages, batches, lambda s, k: k, lr=0.1)
    for s in range(3):
        executors[s][s].write_back()
        assert torch.equal(model_stages[s].weight, expected[s])


def test_vsync_uses_stage_zero_version_everywhere():
    stages, batches = linear_stages(3), regression_batches(9)
    expected = versioned_reference(stages, batches, lambda s, k: max(0, k - 2), lr=0.1)
    for g, e in zip(run_pipeline(stages, batches, "pipedream", policy="vsync"), expected):
        assert torch.equal(g, e)


def test_2bw_update_rule():
    """W(t+1) = W(t) - lr * grad(W(t-1)), gradients accumulated over the m microbatches of a batch."""
    stages = linear_stages(2)
    m, batches_count = 2, 5
    micro = regression_batches(m * batches_count, size=2)
    batches = [(torch.cat([micro[2 * t][0], micro[2 * t + 1][0]]), torch.cat([micro[2 * t][1], micro[2 * t + 1][1]]))
               for t in range(batches_count)]
    expected = versioned_reference(stages, micro, lambda s, k: max(0, k // m - 1), lr=0.1, units_per_update=m)
    got = run_pipeline(stages, batches, "2bw", microbatches=m)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-13)


def test_emulator_holds_no_more_versions_than_the_schedule_says():
    from pipetrain.schedule import memory_by_rank

    stages, batches = linear_stages(4), regression_batches(12)
    model_stages = [copy.deepcopy(s) for s in stages]
    schedule = build("pipedream", 4, 12)
    executors = [{s: StageExecutor(s, model_stages[s], SGD(lr=0.1), loss_fn=mse if s == 3 else None,
                                   policy="stash")} for s in range(4)]
    data = UnitData(None, UnitLayout(4, 1), lambda t: t, lambda _d, t: batches[t])
    Emulator(schedule, executors, data).run()
    memory = memory_by_rank(schedule)
    assert [executors[s][s].versions.peak for s in range(4)] == [memory[s].peak_versions[s] for s in range(4)]
    assert [executors[s][s].versions.peak for s in range(4)] == [4, 3, 2, 1]
