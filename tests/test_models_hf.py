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
import math

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


def test_a_gpt2_built_by_the_user_is_told_how_to_cut_it_and_trains_that_way():
    from pipetrain.errors import ConfigError
    from pipetrain.models import CrossEntropy
    from pipetrain.models.hf import declare_units, gpt2_units

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=20,
                                                                 n_positions=8))
    with pytest.raises(ConfigError, match=r"For this HuggingFace model, declare its blocks as the units instead of "
                                          r"tracing: pipetrain\.models\.hf\.declare_units\(model, gpt2_units\(model\)"):
        split_model(model, stages=2)
    declare_units(model, gpt2_units(model), loss=CrossEntropy(shift=1))
    ids = torch.randint(0, 20, (16, 8), generator=torch.Generator().manual_seed(0))
    result = Pipeline(model, stages=2, executor="emulate").fit([(row, row) for row in ids], batch_size=8, steps=1,
                                                                progress=False, quiet=True)
    assert result.updates == 1 and result.stages == 2 and math.isfinite(result.final_loss)


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


GPT2_TEXT = "pipetrain.models.hf:gpt2:n_layer=2,n_embd=16,n_head=2"


@pytest.fixture(scope="module")
def runtime_runs(tmp_path_factory):
    """One launch of two worker processes for the runtime's tests of this file (starting them costs
    most of the time): the CLI's GPT-2 on text, and the user's GPT-2 and BERT on padded dict batches;
    each run equals the emulator's bitwise. Their saved state dicts by name."""
    out = tmp_path_factory.mktemp("runtime")
    base = dict(batch_size=8, steps=3, microbatches=2, schedule="1f1b", stages=2, optimizer="sgd:lr=0.1,momentum=0.9",
                progress=False, timeout=60.0, executor="distributed", balance_by="params", eval_every=0)
    configs = {"text": TrainConfig(**{**base, "batch_size": 4, "optimizer": "sgd:lr=0.1"}, model=GPT2_TEXT,
                                   data="text:block_size=12")}
    for which in ("gpt2", "bert"):  # untied: bitwise plain training with two microbatches
        configs[which] = TrainConfig(**base, model=f"test_models_hf:user_{which}:tie=false",
                                     data=f"test_models_hf:padded_{which}_data")
    configs = {k: dataclasses.replace(c, save=str(out / f"{k}-distributed.pt")) for k, c in configs.items()}
    assert_distributed_equals_emulated(list(configs.values()), 2, timeout=240)
    return {k: torch.load(c.save) for k, c in configs.items()}


def test_the_cli_trains_gpt2_on_text_with_both_executors_and_saves_hf_weights(runtime_runs):
    saved = runtime_runs["text"]
    model = build_model(GPT2_TEXT, input_shape=(12,), num_classes=96)
    fresh = transformers.GPT2LMHeadModel(model.config)
    fresh.load_state_dict(saved, strict=True)
    assert torch.equal(fresh.lm_head.weight, saved["transformer.wte.weight"])


# -- padded batches as HF users give them: {"input_ids", "attention_mask"} ---------------------------

from torch.utils.data import Dataset  # noqa: E402

from pipetrain.data import BatchSampler, get_batch  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.models import CrossEntropy  # noqa: E402
from pipetrain.models.hf import bert_units, declare_units, gpt2_units  # noqa: E402


class Padded(Dataset):
    """What an HF tokenizer gives with ``padding=True``: x = ``{"input_ids", "attention_mask"}``
    (0-padded at the end, lengths 3 ... LENGTH; BERT's also ``"token_type_ids"``, a second segment
    from half the length), y the labels, -100 on the padding: for GPT-2 the ids (shifted in the
    loss), for BERT the ids of the masked positions (replaced by the mask id 2), -100 elsewhere."""

    num_classes = VOCAB

    def __init__(self, which: str, samples: int = 24) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, LENGTH + 1, (samples, 1), generator=g)
        self.which, self.mask = which, (torch.arange(LENGTH) < lengths).long()
        self.ids = torch.randint(3, VOCAB, (samples, LENGTH), generator=g) * self.mask
        self.types = ((torch.arange(LENGTH) >= lengths // 2) & (self.mask > 0)).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        if which == "bert":
            chosen = ((torch.rand((samples, LENGTH), generator=g) < 0.3) | (torch.arange(LENGTH) == 0)) & (self.mask > 0)
            self.ids, self.labels = self.ids.masked_fill(chosen, 2), self.labels.masked_fill(~chosen, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        x = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.which == "bert":
            x["token_type_ids"] = self.types[i]
        return x, self.labels[i]


def padded_gpt2_data() -> Padded:
    return Padded("gpt2")


def padded_bert_data() -> Padded:
    return Padded("bert")


def user_gpt2(input_shape=(LENGTH,), num_classes=VOCAB, tie=True):
    """A user's own GPT2LMHeadModel (no dropout), declared as units with the loss of labels=ids."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=num_classes, n_positions=input_shape[0], n_layer=3, n_embd=16,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    model = transformers.GPT2LMHeadModel(config)
    return declare_units(model, gpt2_units(model), loss=CrossEntropy(shift=1))


def user_bert(input_shape=(LENGTH,), num_classes=VOCAB, tie=True):
    """A user's own BertForMaskedLM (no dropout), declared as units with BERT's loss."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=num_classes, max_position_embeddings=input_shape[0],
                                     num_hidden_layers=3, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                                     tie_word_embeddings=tie)
    model = transformers.BertForMaskedLM(config)
    return declare_units(model, bert_units(model), loss=CrossEntropy())


USERS = {"gpt2": user_gpt2, "bert": user_bert}


def plain_dict_training(model, dataset, steps, batch_size, microbatches):
    """Plain HF training on the batches ``fit`` samples: ``model(**x, labels=y).loss`` of each
    microbatch weighted by its share of the samples, accumulated, one SGD step; the update losses."""
    sampler = BatchSampler(dataset, batch_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    losses = []
    for t in range(steps):
        x, y = get_batch(dataset, sampler.indices(t))
        opt.zero_grad()
        parts = {k: v.tensor_split(microbatches) for k, v in x.items()}
        total = 0.0
        for m, labels in enumerate(y.tensor_split(microbatches)):
            loss = model(**{k: v[m] for k, v in parts.items()}, labels=labels).loss * (len(labels) / batch_size)
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("form", ["tensor", "ids", "padded"])
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_the_units_take_token_ids_or_hf_dicts_and_compute_the_hf_forward(which, form, attention):
    """Each form a user of HF passes (padded: with the mask, and BERT's token types) gives the HF
    model's logits and gradients bit for bit; the padding mask changes them. Under eager attention
    too, whose causal mask the units build as HF does (compared with GPT-2's forward without its
    cache, which rounds eager attention differently, about 1e-7)."""
    model = USERS[which]()
    model.set_attn_implementation(attention)
    x, _ = get_batch(Padded(which), range(6))
    if form != "padded":
        x = x["input_ids"] if form == "tensor" else {"input_ids": x["input_ids"]}
    given = x if isinstance(x, dict) else {"input_ids": x}
    expected = model(**given, **({"use_cache": False} if which == "gpt2" and attention == "eager" else {})).logits
    expected.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = run_stages(split_model(model, stages=3).stages, x)
    assert torch.equal(out, expected)
    out.sum().backward()
    for key, p in model.named_parameters():
        assert torch.equal(p.grad, grads[key]), key
    if form == "padded":
        assert not torch.equal(out, model(input_ids=given["input_ids"]).logits)  # the mask counts


@pytest.mark.parametrize("tie, microbatches", [(True, 1), (False, 2)], ids=["tied-1", "untied-2"])
@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_padded_dict_batches_train_as_plain_hf_training(which, tie, microbatches):
    """1F1B on 3 stages with the emulator equals plain HF training bitwise. Tied weights with two
    microbatches per step would add the embedding's and the head's gradients in another order (about
    1e-8, see the module docstring): the HF model's own tied weights with one, untied with two."""
    data = Padded(which)
    model = USERS[which](tie=tie)
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, stages=3, schedule="1f1b", microbatches=microbatches,
                    optimizer="sgd:lr=0.1,momentum=0.9", executor="emulate")
    losses = pipe.fit(data, batch_size=8, steps=3, quiet=True, progress=False).update_losses
    expected_losses = plain_dict_training(reference, data, 3, 8, microbatches)
    trained = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        assert torch.equal(trained[name], expected), name
    # GPT-2's loss as reported: HF's mean runs over T positions (the last ignored), the shifted one over
    # T - 1, and rounds differently (about 1e-7); the gradients are the same bits
    assert list(losses) == (expected_losses if which == "bert" else pytest.approx(expected_losses, rel=1e-6))
    type(model)(model.config).load_state_dict(pipe.state_dict(), strict=True)


def test_the_runtime_trains_padded_dict_batches_as_plain_hf_training(runtime_runs):
    """Two processes, the raw masks crossing between them (the fixture: bitwise the emulator), and
    bitwise plain HF training."""
    for which, make in USERS.items():
        reference = make(tie=False)
        plain_dict_training(reference, Padded(which), 3, 8, 2)
        saved = runtime_runs[which]
        assert saved.keys() == reference.state_dict().keys()
        for name, expected in reference.state_dict().items():
            assert torch.equal(saved[name], expected), (which, name)


@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_a_form_the_units_cannot_take_is_refused_naming_those_they_take(which):
    model = USERS[which]()
    ids = torch.randint(1, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(0))
    keys = "'input_ids', 'attention_mask'" + (", 'token_type_ids'" if which == "bert" else "")
    forms = rf"units take x as token ids \(a tensor \(B, T\)\) or a dict of HF's arguments \{{{keys}\}}"
    for x, got in [([ids, torch.ones_like(ids)], "got a tuple or list of 2"),
                   ({"input_ids": ids, "labels": ids}, "got a dict with also 'labels'"),
                   ({"attention_mask": torch.ones_like(ids)}, "got a dict without 'input_ids'")]:
        pipe = Pipeline(model, stages=2, executor="emulate")
        with pytest.raises(ConfigError, match=forms + ".*" + got):
            pipe.train([(x, ids)])
    if which == "gpt2":  # GPT-2's tokenizer gives no token types: the key is not among its forms
        with pytest.raises(ConfigError, match=forms + r".*got a dict with also 'token_type_ids'"):
            Pipeline(model, stages=2, executor="emulate").train([({"input_ids": ids, "token_type_ids": ids}, ids)])


# -- encoder-decoders: T5 and BART ---------------------------------------------------------------

from pipetrain.models.hf import bart, t5  # noqa: E402

SOURCE, TARGET = 9, 7


class T5Copies(Dataset):
    """x = {input_ids, attention_mask, decoder_input_ids} (padded sources, labels shifted right behind
    the start token 0), y = the labels: the source's first tokens."""

    num_classes = VOCAB

    def __init__(self, samples: int = 24, split: str = "train") -> None:
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.ids = torch.randint(2, VOCAB, (samples, SOURCE), generator=g)
        self.mask = (torch.arange(SOURCE) < torch.randint(TARGET, SOURCE + 1, (samples, 1), generator=g)).long()
        self.ids = self.ids * self.mask
        self.labels = self.ids[:, :TARGET]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        decoder = torch.cat([torch.zeros(1, dtype=torch.long), self.labels[i, :-1]])
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "decoder_input_ids": decoder}, self.labels[i]


def t5_copies(samples: int = 24, split: str = "train") -> T5Copies:
    return T5Copies(samples, split)


def stage_starts(model, staged):
    """The unit that starts each stage after the first."""
    names = [n for n, _ in model.pipeline_units]
    return [names[sum(staged.balance[:s])] for s in range(1, len(staged.balance))]


def tiny_seq2seq(make, layers=3):
    torch.manual_seed(0)
    if make is t5:
        return t5(input_shape=(SOURCE,), num_classes=VOCAB, num_layers=layers, num_heads=2, d_model=16)
    return bart(input_shape=(SOURCE,), num_classes=VOCAB, encoder_layers=layers, attention_heads=2, d_model=16)


def seq2seq_batch(size=4, padded=True):
    data = T5Copies()
    x, y = [], []
    for i in range(size):
        sample, label = data[i]
        x.append(sample)
        y.append(label)
    x = {k: torch.stack([s[k] for s in x]) for k in x[0]}
    if not padded:
        del x["attention_mask"]
    return x, torch.stack(y)


@pytest.mark.parametrize("padded", [True, False], ids=["masks", "no-masks"])
@pytest.mark.parametrize("make", [t5, bart], ids=["t5", "bart"])
def test_encoder_decoder_units_compute_the_hf_loss_and_gradients(make, padded):
    model = tiny_seq2seq(make)
    assert [n for n, _ in model.pipeline_units] == [
        "embed", "encoder0", "encoder1", "encoder2", "decoder_embed", "decoder0", "decoder1", "decoder2", "head"]
    x, y = seq2seq_batch(padded=padded)
    x["decoder_attention_mask"] = torch.ones_like(x["decoder_input_ids"])
    x["decoder_attention_mask"][0, -2:] = 0
    expected = model(**x, labels=y)
    expected.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    staged = split_model(model, stages=4)
    starts = stage_starts(model, staged)
    assert starts[0].startswith("encoder") and starts[-1].startswith("decoder")
    logits = run_stages(staged.stages, x)
    loss = model.pipeline_loss(logits, y)
    assert torch.equal(logits, expected.logits) and torch.equal(loss, expected.loss)
    loss.backward()
    for key, p in model.named_parameters():
        assert torch.equal(p.grad, grads[key]), key


def test_a_12_plus_12_layer_t5_splits_into_4_balanced_stages():
    torch.manual_seed(0)
    model = t5(input_shape=(16,), num_classes=512, num_layers=12, d_model=64, num_heads=4)
    staged = split_model(model, stages=4)
    counts = staged.parameter_counts()
    assert max(counts) < 1.1 * sum(counts) / 4, counts  # within a tenth of the mean (a layer is ~1/14 of it)
    starts = stage_starts(model, staged)
    assert starts[0].startswith("encoder") and starts[-1].startswith("decoder"), starts
    assert [t.stages for t in staged.tied] == [(0, 1, 3)]  # the shared embedding: encoder, decoder, head


def test_seq2seq_x_must_name_its_parts():
    model = tiny_seq2seq(t5, layers=1)
    staged = split_model(model, stages=2)
    ids = torch.ones(2, SOURCE, dtype=torch.long)
    with pytest.raises(ConfigError, match="lacks decoder_input_ids.*prepare_decoder_input_ids_from_labels"):
        run_stages(staged.stages, {"input_ids": ids})
    with pytest.raises(ConfigError, match="got also labels"):
        run_stages(staged.stages, {"input_ids": ids, "decoder_input_ids": ids, "labels": ids})
    assert run_stages(staged.stages, (ids, ids)).shape == (2, SOURCE, VOCAB)  # (input_ids, decoder_input_ids)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_t5_trains_on_dict_batches_as_plain_hf_training(microbatches):
    data = T5Copies()
    model = tiny_seq2seq(t5, layers=2)
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, stages=3, schedule="1f1b", microbatches=microbatches, optimizer="sgd:lr=0.1,momentum=0.9",
                    executor="emulate")
    losses = pipe.fit(data, batch_size=8, steps=3, quiet=True).update_losses
    expected_losses = plain_dict_training(reference, data, 3, 8, microbatches)
    trained = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        if microbatches == 1:
            assert torch.equal(trained[name], expected), name
        else:  # the shared embedding's three uses add in another order (see the module docstring)
            torch.testing.assert_close(trained[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert list(losses) == pytest.approx(expected_losses, rel=0 if microbatches == 1 else 1e-6)
    fresh = transformers.T5ForConditionalGeneration(model.config)
    fresh.load_state_dict(pipe.state_dict(), strict=True)


def test_asynchronous_schedules_refuse_t5s_shared_embedding_naming_its_uses():
    model = tiny_seq2seq(t5, layers=2)
    with pytest.raises(ConfigError) as info:
        Pipeline(model, stages=3, schedule="pipedream", executor="emulate").start(steps=1, batch_size=4)
    message = str(info.value)
    assert ("'shared.weight' (stage 0 as encoder.embed_tokens.weight, stage 1 as decoder.embed_tokens.weight, "
            "stage 2 as lm_head.weight)") in message
    assert ("model.decoder.embed_tokens.weight = nn.Parameter(model.encoder.embed_tokens.weight.detach().clone()); "
            "model.lm_head.weight = nn.Parameter(model.encoder.embed_tokens.weight.detach().clone())") in message


def test_a_t5_trained_from_meta_saves_a_directory_from_pretrained_reads(tmp_path):
    with torch.device("meta"):
        meta = tiny_seq2seq(t5)
    pipe = Pipeline(meta, stages=3, schedule="1f1b", microbatches=2, executor="emulate", optimizer="adam:lr=0.01",
                    init=lambda module, name: meta._init_weights(module))
    pipe.fit(T5Copies(), batch_size=4, steps=2, save=str(tmp_path / "t5"), quiet=True, progress=False)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "t5")
    trained = pipe.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
    assert loaded.lm_head.weight is loaded.shared.weight or not loaded.config.tie_word_embeddings
