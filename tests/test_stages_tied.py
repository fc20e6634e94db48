"""Tests of finding parameters shared by several stages (tied weights) in every form of cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.models import build_model
from pipetrain.stages import TiedParameter, find_tied, from_stages, refuse_tied, split_model


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.wte(ids)


class Head(nn.Module):
    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed.wte.embedding_dim)
        self.out = nn.Linear(embed.wte.embedding_dim, embed.wte.num_embeddings, bias=False)
        self.out.weight = embed.wte.weight  # tied to the input embedding


def tied_units(vocab: int = 11, width: int = 8) -> list[nn.Module]:
    embed = Embed(vocab, width)
    head = Head(embed)
    return [embed, nn.Sequential(nn.Linear(width, width), nn.Tanh()), nn.Sequential(head.norm, head.out)]


def test_a_list_of_stages_sharing_a_parameter_is_tied_not_untied():
    stages = tied_units()
    staged = split_model(stages)
    assert staged.tied == [TiedParameter("0.wte.weight", ((0, "wte.weight"), (2, "1.weight")), True,
                                         ("0.wte.weight", "2.1.weight"))]
    assert staged.aliases == {"2.1.weight": "0.wte.weight"}


def test_a_sequential_cut_between_the_uses_is_tied():
    whole = nn.Sequential(*tied_units())
    assert split_model(whole, balance=[1, 1, 1]).tied[0].stages == (0, 2)
    assert split_model(whole, balance=[1, 2]).tied[0].holders == ((0, "0.wte.weight"), (1, "2.1.weight"))
    assert split_model(whole, balance=[3]).tied == []  # both uses in one stage: an alias, as before


def test_explicit_stages_of_a_model_name_the_models_key():
    whole = nn.Sequential(*tied_units())
    staged = from_stages([whole[0], nn.Sequential(whole[1], whole[2])], whole)
    assert staged.tied[0].name == "0.wte.weight" and staged.tied[0].keys == ("0.wte.weight", "2.1.weight")
    assert staged.tied[0].holders == ((0, "wte.weight"), (1, "1.1.weight"))


def test_a_traced_model_cut_between_the_uses_is_tied():
    model = build_model("gpt:n_layer=2,n_head=2,n_embd=16,tie=true", input_shape=(12,), num_classes=11, seed=0)
    staged = split_model(model, stages=2)
    assert staged.tied == [TiedParameter("wte.weight", ((0, "wte.weight"), (1, "head.weight")), True,
                                         ("wte.weight", "head.weight"))]
    frozen = find_tied(staged.stages, model)
    assert frozen == staged.tied
    model.wte.weight.requires_grad_(False)
    assert not find_tied(staged.stages, model)[0].trainable
    refuse_tied(find_tied(staged.stages, model), "whatever")  # frozen: nothing can drift


def test_refusal_names_the_parameter_the_stages_and_the_fix():
    staged = split_model(nn.Sequential(*tied_units()), balance=[1, 2])
    with pytest.raises(ConfigError) as info:
        refuse_tied(staged.tied, "the pipedream schedule keeps several weight versions per stage")
    message = str(info.value)
    for words in ("'0.wte.weight' (stage 0 as 0.wte.weight, stage 1 as 2.1.weight)", "stages 0 and 1",
                  "pipedream", "1f1b", "in one stage", "model.2.1.weight = nn.Parameter(model.0.wte.weight"):
        assert words in message, words


def test_saving_refuses_copies_that_differ_and_writes_one_tensor():
    stages = tied_units()
    staged = split_model(stages)
    states = [s.state_dict() for s in stages]
    merged = staged.merge_state_dict(states)
    assert merged["2.1.weight"] is merged["0.wte.weight"]
    nn.Sequential(*tied_units()).load_state_dict(merged, strict=True)
    states[2] = {k: v.clone() for k, v in states[2].items()}
    states[2]["1.weight"] += 1e-7
    with pytest.raises(PipetrainError, match="shared parameter '0.wte.weight'.*differ between stage 0 and stage 2"):
        staged.merge_state_dict(states)
    assert torch.equal(merged["0.wte.weight"], stages[0].wte.weight)


class Unit(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_units_name_each_use_by_the_models_key():
    """A model that declares its units (as the HF recipes do) holds its parameters under unit names
    (``b.inner.out.weight``); messages name the uses as the model does."""
    embed = Embed(11, 8)
    model = nn.ModuleDict({"embed": embed, "head": Head(embed)})
    model.pipeline_units = [("a", Unit(embed)), ("b", Unit(model["head"]))]
    staged = split_model(model, stages=2)
    tied = staged.tied[0]
    assert tied.holders == ((0, "a.inner.wte.weight"), (1, "b.inner.out.weight"))
    assert tied.uses == ("embed.wte.weight", "head.out.weight")
    assert tied.describe() == "'embed.wte.weight' (stage 0 as embed.wte.weight, stage 1 as head.out.weight)"
    with pytest.raises(ConfigError, match=r"e\.g\. model\.head\.out\.weight = nn\.Parameter\(model\.embed\.wte\.weight"):
        refuse_tied(staged.tied, "whatever")
