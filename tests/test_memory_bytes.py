"""Memory predicted in bytes: what training adds per rank (gradient sums, optimizer state, weight
versions beyond the first, activations in flight), on hand-computed schedules; a microbatch's held
bytes sized on the meta device; the report's ``predicted_bytes`` beside the measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.schedule import build
from pipetrain.schedule.memory import StageSizes, bytes_by_rank
from pipetrain.training.config import TrainConfig


def test_one_f_one_b_holds_its_depth_of_microbatches():
    """2 stages, 4 microbatches: rank 0 holds 2 microbatches at its peak, rank 1 one; flush: one version."""
    sizes = [StageSizes(parameters=100, optimizer=100, held=10), StageSizes(parameters=200, optimizer=0, held=20)]
    ranks = bytes_by_rank(build("1f1b", 2, 4, communication=False), sizes)
    assert ranks[0] == {"gradients": 100, "optimizer": 100, "versions": 0, "activations": 20, "total": 220}
    assert ranks[1] == {"gradients": 200, "optimizer": 0, "versions": 0, "activations": 20, "total": 220}
    gpipe = bytes_by_rank(build("gpipe", 2, 4, communication=False), sizes)
    assert [r["activations"] for r in gpipe] == [40, 80]


def test_pipedream_counts_its_stashed_versions():
    """PipeDream on 3 stages keeps 3, 2, 1 versions in steady state: 2, 1, 0 beyond the first."""
    sizes = [StageSizes(parameters=1000, optimizer=0, held=1)] * 3
    ranks = bytes_by_rank(build("pipedream", 3, 12, communication=False), sizes)
    assert [r["versions"] for r in ranks] == [2000, 1000, 0]
    assert [r["activations"] for r in ranks] == [3, 2, 1]


def test_a_split_backward_keeps_the_graph_until_w_and_recomputation_keeps_inputs():
    """F0 F1 I0 I1 W0 W1 on one stage: both graphs live until their W (2 x held), not until I."""
    schedule = build("zb-h1", 1, 2, communication=False)
    kinds = [a.kind.value for a in schedule.programs[0] if a.kind.value in ("F", "I", "W")]
    sizes = [StageSizes(parameters=0, optimizer=0, held=10, inputs=3)]
    activations = bytes_by_rank(schedule, sizes)[0]["activations"]
    held_at_once, now = 0, 0
    for kind in kinds:
        now += {"F": 10, "I": 0, "W": -10}[kind]
        held_at_once = max(held_at_once, now)
    assert activations == held_at_once
    # recomputing: 1f1b on 1 stage runs F B F B: an input is kept, then the whole graph during B
    again = bytes_by_rank(build("1f1b", 1, 2, communication=False), sizes, recompute=True)[0]
    assert again["activations"] == 10


def test_sizes_must_match_the_stages():
    with pytest.raises(ValueError, match="2 stage sizes for 3 stages"):
        bytes_by_rank(build("1f1b", 3, 3), [StageSizes(1, 1, 1)] * 2)


def _prepared(**overrides):
    from pipetrain.training.setup import prepare

    config = dict(executor="emulate", schedule="1f1b", stages=2, model="mlp:depth=2,width=8",
                  data="synthetic:features=6,classes=2,samples=64", batch_size=8, microbatches=2, steps=4,
                  progress=False, quiet=True, optimizer="sgd:lr=0.1,momentum=0.9")
    config.update(overrides)
    return prepare(TrainConfig(**config))


def test_a_microbatch_is_sized_from_what_autograd_saves():
    """Each stage's held bytes: its input, output and autograd's saved tensors, each storage once,
    its own weights not; sized on the meta device, so the model is not run."""
    from pipetrain.training.shapes import microbatch_bytes

    run = _prepared()
    sizes = microbatch_bytes(run)
    assert sizes is not None and len(sizes) == 2
    # a microbatch of 4 rows: every stage keeps at least its input and output, each 4 x width floats
    for stage, size in zip(run.staged.stages, sizes):
        assert size.output == 4 * 4 * [m for m in stage.modules() if isinstance(m, nn.Linear)][-1].out_features
        assert size.held >= size.output + size.inputs
    assert sizes[0].inputs == 4 * 6 * 4  # the first stage's input: 4 rows of 6 features

    class Saves(nn.Module):  # a known set of saved tensors: x (by mul) and tanh's result
        def forward(self, x):
            return torch.tanh(x * x)

    run.staged.stages[1] = Saves()
    held = microbatch_bytes(run)[1]
    # input (saved by mul, once), x*x (not saved: tanh saves its result), the result (saved and the output)
    assert (held.inputs, held.output, held.held) == (4 * 8 * 4, 4 * 8 * 4, 2 * 4 * 8 * 4)
    run.staged.stages[1] = nn.Linear(8, 100)  # saves its input and its weight (for the input's gradient)
    held = microbatch_bytes(run)[1]
    assert (held.inputs, held.output, held.held) == (4 * 8 * 4, 4 * 100 * 4, 4 * 8 * 4 + 4 * 100 * 4)


def test_the_report_predicts_bytes_from_the_parameters_and_the_optimizer():
    from pipetrain.training.memory_report import predicted_bytes

    run = _prepared()
    ranks = predicted_bytes(run)
    for stage, parts in zip(run.staged.stages, ranks):
        parameters = sum(p.numel() * 4 for p in stage.parameters())
        assert parts["gradients"] == parameters and parts["optimizer"] == parameters  # momentum: one slot
        assert parts["versions"] == 0 and parts["activations"] > 0
    plain = predicted_bytes(_prepared(optimizer="sgd:lr=0.1"))
    assert all(parts["optimizer"] == 0 for parts in plain)
    assert predicted_bytes(_prepared(schedule="pipedream"))[0]["versions"] > 0


def test_an_emulated_run_reports_predicted_bytes_beside_the_measured():
    from pipetrain.training.emulated import train_emulated

    run = _prepared(steps=3)
    memory = train_emulated(run).extra["memory"]
    assert all(stage["predicted_bytes"] == stage["predicted_parts"]["total"] > 0 for stage in memory["stages"])
    assert memory["predicted_bytes"] == sum(stage["predicted_bytes"] for stage in memory["stages"])


def test_an_update_made_during_the_backward_holds_one_gradient_at_a_time():
    """One microbatch per update on one version: each parameter is updated as its gradient is made
    (pipetrain.execution.update_in_backward), so the stage holds its largest parameter's gradient."""
    from pipetrain.training.memory_report import predicted_bytes

    run = _prepared(microbatches=1)
    for stage, parts in zip(run.staged.stages, predicted_bytes(run)):
        assert parts["gradients"] == max(p.numel() * 4 for p in stage.parameters())
    assert predicted_bytes(_prepared(microbatches=2))[0]["gradients"] == \
        sum(p.numel() * 4 for p in run.staged.stages[0].parameters())
