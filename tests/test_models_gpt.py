"""Tests of the `gpt` model: shapes, training step, options, tying, generation, registry errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.data import CharVocab
from pipetrain.errors import ConfigError
from pipetrain.models import GPT, build_model, cross_entropy, generate
from pipetrain.stages import split_model


def tiny(**options) -> GPT:
    spec = "gpt:" + ",".join(f"{k}={v}" for k, v in {"n_layer": 2, "n_head": 2, "n_embd": 16, **options}.items())
    return build_model(spec, input_shape=(10,), num_classes=13, seed=0)


def test_forward_backward_shapes_and_gradients():
    model = tiny()
    assert (model.vocab_size, model.block_size) == (13, 10)
    x = torch.randint(0, 13, (3, 10))
    logits = model(x)
    assert logits.shape == (3, 10, 13) and logits.dtype == torch.float32
    loss = cross_entropy(logits, torch.randint(0, 13, (3, 10)))
    assert abs(loss.item() - torch.log(torch.tensor(13.0)).item()) < 0.1  # near uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(x[:, :4]).shape == (3, 4, 13)  # any length up to block_size


def test_causal_future_tokens_do_not_change_the_past():
    model = tiny().double()
    x = torch.randint(0, 13, (2, 10))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 13
    torch.testing.assert_close(model(x)[:, :6], model(y)[:, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(model(x)[:, 6:], model(y)[:, 6:])


def test_a_few_steps_learn_a_repeating_sequence():
    torch.manual_seed(0)
    model = tiny()
    data = torch.arange(11).repeat(4) % 13
    x, y = data[None, :10].repeat(8, 1), data[None, 1:11].repeat(8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        optimizer.zero_grad()
        loss = cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2 * first


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(AssertionError, match="longer than block_size"):
        tiny()(torch.zeros(1, 11, dtype=torch.long))


def test_options_and_parameter_count():
    model = tiny(n_layer=3, n_embd=32, n_head=4, bias="false", block_size=20)
    assert len(model.blocks) == 3 and model.block_size == 20 and model.wpe.num_embeddings == 20
    assert model.blocks[0].attn.qkv.bias is None
    c, v, t = 32, 13, 20
    per_block = c + 3 * c * c + c * c + c + 4 * c * c + 4 * c * c  # no biases: LayerNorm weight only
    assert sum(p.numel() for p in model.parameters()) == v * c + t * c + 3 * per_block + c + c * v
    assert tiny().head.weight is not tiny().wte.weight
    tied = tiny(tie="true")
    assert tied.head.weight is tied.wte.weight
    assert sum(p.numel() for p in tied.parameters()) == sum(p.numel() for p in tiny().parameters()) - 13 * 16


def test_dropout_follows_train_and_eval_after_splitting():
    model = tiny(dropout=0.5)
    staged = split_model(model, stages=2)
    x = torch.randint(0, 13, (2, 10))
    for stage in staged.stages:
        stage.eval()
    assert torch.equal(staged(x), staged(x))
    for stage in staged.stages:
        stage.train()
    assert not torch.equal(staged(x), staged(x))


@pytest.mark.parametrize(
    "options, word",
    [({"n_head": 3}, "must divide n_embd"), ({"n_layer": 0}, "n_layer must be an integer >= 1"),
     ({"dropout": 1.5}, "dropout"), ({"depth": 2}, "does not accept option 'depth'")],
)
def test_option_errors(options, word):
    with pytest.raises(ConfigError, match=word):
        tiny(**options)


def test_image_input_is_refused():
    with pytest.raises(ConfigError, match="sequences of token ids"):
        build_model("gpt", input_shape=(8, 8), num_classes=10)


def test_generate_is_deterministic_under_a_seed():
    vocab = CharVocab("abcdefghijklm")
    model = tiny()
    a = generate(model, vocab, "abc", 30, seed=3)
    assert len(a) == 30 and set(a) <= set(vocab.chars)
    assert generate(model, vocab, "abc", 30, seed=3) == a
    assert generate(model, vocab, "abc", 30, seed=4) != a
    staged = split_model(model, stages=2)
    assert generate(staged, vocab, "abc", 30, seed=3, block_size=10) == a  # stages = the model
    assert model.training  # mode restored
    greedy = generate(model, vocab, "abc", 12, top_k=1)
    assert greedy == generate(model, vocab, "abc", 12, top_k=1, seed=99)
    assert generate(model, vocab, "a", 0) == ""


def test_generate_errors():
    vocab = CharVocab("abcdefghijklm")
    with pytest.raises(ConfigError, match="block_size"):
        generate(split_model(tiny(), stages=2), vocab, "a", 3)
    with pytest.raises(ConfigError, match="at least one character"):
        generate(tiny(), vocab, "", 3)
    with pytest.raises(ConfigError, match="temperature"):
        generate(tiny(), vocab, "a", 3, temperature=0)


def test_is_an_ordinary_module_not_a_sequential():
    assert isinstance(tiny(), nn.Module) and not isinstance(tiny(), nn.Sequential)
    names = [n for n, _ in tiny().named_children()]
    assert names == ["wte", "wpe", "drop", "blocks", "ln_f", "head"]
