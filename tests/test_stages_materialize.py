"""Materialising the stages of a model built on the meta device, and their first values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models.gpt import GPT
from pipetrain.stages import split_model
from pipetrain.initialiser import resolve_init
from pipetrain.stages.materialize import has_meta, materialize, seed_for
from pipetrain.weights import save_weights


def meta_gpt(tie: bool = False) -> GPT:
    with torch.device("meta"):
        return GPT(20, 8, n_layer=4, n_head=2, n_embd=16, tie=tie)


def whole(model: nn.Module, init="reset", seed=3) -> dict[str, torch.Tensor]:
    materialize(model, model, resolve_init(init), seed=seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_reset_gives_every_cut_the_same_weights_in_one_process_or_one_stage_per_process(tie):
    reference = whole(meta_gpt(tie))
    assert not torch.equal(reference["blocks.0.attn.qkv.weight"], reference["blocks.1.attn.qkv.weight"])
    for stages in (2, 4):
        model = meta_gpt(tie)  # the emulator: every stage in this process, one after the other
        staged = split_model(model, stages=stages)
        for stage in staged.stages:
            materialize(model, stage, resolve_init("reset"), seed=3)
        assert not has_meta(model)
        assert all(torch.equal(model.state_dict()[k], reference[k]) for k in reference)
        for s in range(stages):  # a worker: its stage alone, the rest of the model left on meta
            model = meta_gpt(tie)
            staged = split_model(model, stages=stages)
            materialize(model, staged.stages[s], resolve_init("reset"), seed=3)
            for key, value in staged.stages[s].state_dict().items():
                assert torch.equal(value, reference[staged.key_map[s][key]]), (stages, s, key)
            assert has_meta(model) or stages == 1
    if tie:
        model = meta_gpt(tie)
        materialize(model, model, resolve_init("reset"), seed=3)
        assert model.head.weight is model.wte.weight  # still one tensor


def test_the_seed_and_the_module_name_choose_the_values():
    a, b = whole(meta_gpt(), seed=3), whole(meta_gpt(), seed=4)
    assert not torch.equal(a["wte.weight"], b["wte.weight"])
    with torch.random.fork_rng():
        torch.manual_seed(seed_for(3, "blocks.2.ln1"))
        expected = nn.LayerNorm(16)  # a LayerNorm's reset draws nothing: ones and zeros
    assert torch.equal(a["blocks.2.ln1.weight"], expected.weight.detach())
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    whole(meta_gpt())
    assert torch.equal(torch.rand(1), before)  # the caller's random state is left alone


def test_a_function_is_called_for_the_modules_of_the_stage_children_first():
    model = meta_gpt()
    staged = split_model(model, split_at=["blocks.2"])
    calls = []

    def init(module: nn.Module, name: str) -> None:
        calls.append(name)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    materialize(model, staged.stages[1], resolve_init(init), seed=0)
    assert "blocks.2" in calls and "blocks.2.attn.qkv" in calls
    assert calls.index("blocks.2.attn.qkv") < calls.index("blocks.2.attn") < calls.index("blocks.2")
    assert "" not in calls and "blocks" not in calls  # they hold tensors of stage 0 too
    assert all(torch.all(v == 0.5) for v in staged.stages[1].state_dict().values())
    assert model.wte.weight.is_meta


def test_weights_from_a_directory_reach_meta_and_eager_models(tmp_path):
    torch.manual_seed(1)
    eager = GPT(20, 8, n_layer=4, n_head=2, n_embd=16)
    save_weights(tmp_path / "w", [eager.state_dict()])
    model = meta_gpt()
    staged = split_model(model, stages=2)
    made = materialize(model, staged.stages[1], resolve_init(str(tmp_path / "w")), seed=0)
    for key, value in staged.stages[1].state_dict().items():
        assert torch.equal(value, eager.state_dict()[staged.key_map[1][key]])
    made.release()
    assert staged.stages[1].get_parameter("head.weight").is_meta  # back on meta, the memory freed
    torch.manual_seed(2)
    other = GPT(20, 8, n_layer=4, n_head=2, n_embd=16)
    materialize(other, other, resolve_init(str(tmp_path / "w")), seed=0)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in eager.state_dict().items())


def test_what_cannot_be_initialised_is_refused_by_name():
    with pytest.raises(ConfigError, match="built on the meta device .* init='reset'"):
        model = meta_gpt()
        materialize(model, model, None, seed=0)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ConfigError, match="cannot give '1.gain' values: .*Scale.* no reset_parameters"):
        materialize(model, model, resolve_init("reset"), seed=0)

    class Whole(nn.Sequential):
        def reset_parameters(self):
            for p in self.parameters():
                nn.init.normal_(p)

    with torch.device("meta"):
        model = Whole(nn.Linear(4, 4), nn.Linear(4, 4))
    staged = split_model(model, stages=2)
    with pytest.raises(ConfigError, match="initialises tensors of several stages"):
        materialize(model, staged.stages[0], resolve_init("reset"), seed=0)


def test_torch_layers_with_private_resets_and_buffers_are_initialised():
    with torch.device("meta"):
        model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True), nn.BatchNorm1d(8))
    materialize(model, model, resolve_init("reset"), seed=0)
    attention, norm = model
    assert not has_meta(model)
    assert torch.all(attention.out_proj.bias == 0) and attention.in_proj_weight.abs().sum() > 0
    assert torch.all(norm.running_var == 1) and int(norm.num_batches_tracked) == 0
