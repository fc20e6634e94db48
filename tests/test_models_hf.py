"""HuggingFace GPT-2 and BERT, random-initialised from a config, as pipelines (transformers optional).

The units compute what the HF model computes, bit for bit; a model cut into stages trains with
1F1B as the HF model trains in plain PyTorch with its own loss (``labels=``): bitwise with one
microbatch per step, to float32 rounding with two (the pipeline adds two partial gradients where
one process computes the batch at once). In float32: HF's losses compute in float32 whatever the
model's dtype; the trained state dict loads back into the HF class with
``strict=True``, the LM head still tied to the embedding.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed_parity import assert_distributed_equals_emulated  # noqa: E402

from pipetrain import Pipeline  # noqa: E402
from pipetrain.models import build_model  # noqa: E402
from pipetrain.models.hf import bert_mlm, gpt2  # noqa: E402
from pipetrain.stages import run_stages, split_model  # noqa: E402
from pipetrain.training import TrainConfig  # noqa: E402

VOCAB, LENGTH = 23, 10


def tiny_gpt2(**options):
    torch.manual_seed(0)
    return gpt2(input_shape=(LENGTH,), num_classes=VOCAB, n_layer=3, n_head=2, n_embd=16, **options)


def tiny_bert():
    torch.manual_seed(0)
    return bert_mlm(input_shape=(LENGTH,), num_classes=VOCAB, num_hidden_layers=3, num_attention_heads=2,
                    hidden_size=16)


def tokens(batches=3, size=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (size, LENGTH), generator=g) for _ in range(batches)]


def masked(ids, seed=2):
    """BERT's masked-LM batches: 30 % of the tokens replaced by 0 ([MASK] here), labels -100 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen[:, 0] = True  # at least one target per sample
    return ids.masked_fill(chosen, 0), ids.masked_fill(~chosen, -100)


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_bert], ids=["gpt2", "bert"])
def test_the_units_compute_the_hf_forward_and_gradients(make):
    model = make()
    ids = tokens(1)[0]
    staged = split_model(model, stages=3)
    expected = model(input_ids=ids).logits
    expected.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = run_stages(staged.stages, ids)
    assert torch.equal(out, expected)
    out.sum().backward()
    for key, p in model.named_parameters():
        assert torch.equal(p.grad, grads[key]), key


def test_gpt2_units_cut_and_saved_weights_load_into_the_hf_class():
    model = tiny_gpt2()
    assert [n for n, _ in model.pipeline_units] == ["embed", "h0", "h1", "h2", "head"]
    staged = split_model(model, split_at=["h1", "h2"])
    assert staged.balance == [2, 1, 2]
    assert [(t.name, t.stages, t.keys) for t in staged.tied] == [
        ("transformer.wte.weight", (0, 2), ("transformer.wte.weight", "lm_head.weight"))]
    merged = staged.merge_state_dict([s.state_dict() for s in staged.stages])
    fresh = transformers.GPT2LMHeadModel(model.config)
    fresh.load_state_dict(merged, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def plain_hf_training(model, batches, microbatches):
    """Plain PyTorch with the HF model's own loss; microbatch losses weighted by their sample share."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for ids, labels in batches:
        opt.zero_grad()
        for x, y in zip(ids.tensor_split(microbatches), labels.tensor_split(microbatches)):
            (model(input_ids=x, labels=y).loss * (len(x) / len(ids))).backward()
        opt.step()


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_1f1b_training_equals_plain_training_of_the_hf_model(which, microbatches):
    model = tiny_gpt2(shift=True) if which == "gpt2" else tiny_bert()
    reference = copy.deepcopy(model)
    batches = [(ids, ids) for ids in tokens()] if which == "gpt2" else [masked(ids) for ids in tokens()]
    pipe = Pipeline(model, executor="emulate", stages=3, schedule="1f1b", microbatches=microbatches,
                    loss_fn=model.pipeline_loss, optimizer="sgd:lr=0.1,momentum=0.9")
    losses = pipe.train(batches)
    plain_hf_training(reference, batches, microbatches)
    trained = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        if microbatches == 1:
            assert torch.equal(trained[name], expected), name
        else:
            torch.testing.assert_close(trained[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert losses[-1] < losses[0]
    fresh = type(model)(model.config)
    fresh.load_state_dict(pipe.state_dict(), strict=True)


def test_the_cli_trains_gpt2_on_text_with_both_executors_and_saves_hf_weights(tmp_path):
    base = dict(model="pipetrain.models.hf:gpt2:n_layer=2,n_embd=16,n_head=2", data="text:block_size=12",
                batch_size=4, steps=3, microbatches=2, schedule="1f1b", stages=2, optimizer="sgd:lr=0.1",
                progress=False, timeout=60.0, executor="distributed", balance_by="params")
    config = dataclasses.replace(TrainConfig(**base), save=str(tmp_path / "gpt2-distributed.pt"))
    assert_distributed_equals_emulated([config], 2, timeout=240)
    saved = torch.load(tmp_path / "gpt2-distributed.pt")
    model = build_model(base["model"], input_shape=(12,), num_classes=96)
    fresh = transformers.GPT2LMHeadModel(model.config)
    fresh.load_state_dict(saved, strict=True)
    assert torch.equal(fresh.lm_head.weight, saved["transformer.wte.weight"])
