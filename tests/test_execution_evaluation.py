"""A stage's forward on held-out data, on its own: eval mode, no graph, the mode put back, a
failure named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import ModelError
from pipetrain.execution.evaluation import evaluate_stage
from pipetrain.execution.parameters import Parameters

CPU = torch.device("cpu")


def test_held_out_data_runs_in_eval_mode_on_the_given_weights_without_a_graph():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    params = {n: p.detach() * 2 for n, p in module.named_parameters()}
    x = torch.randn(6, 3)
    out = evaluate_stage(1, Parameters(module), params, x, CPU)
    assert module.training and not out.requires_grad  # the mode is put back
    module.eval()
    with torch.no_grad():
        expected = torch.func.functional_call(module, params, (x,))
    assert torch.equal(out, expected)  # no dropout, the running statistics
    assert torch.equal(module[1].running_mean, torch.zeros(4))  # eval mode updates no statistics


def test_a_failure_on_held_out_data_is_named_and_the_mode_put_back():
    module = nn.Linear(3, 4)
    params = dict(module.named_parameters())
    with pytest.raises(ModelError, match=r"on held-out data, stage 2 cannot run on its input \(\(6, 5\) float32\)"):
        evaluate_stage(2, Parameters(module), params, torch.randn(6, 5), CPU)
    assert module.training


def test_held_out_data_runs_under_autocast_when_given():
    module = nn.Linear(3, 4)
    out = evaluate_stage(0, Parameters(module), dict(module.named_parameters()), torch.randn(2, 3), CPU,
                         autocast=torch.bfloat16)
    assert out.dtype == torch.bfloat16
