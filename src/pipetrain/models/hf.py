"""HuggingFace GPT-2, BERT, T5 and BART as pipelines: the HF model, cut between units that share its modules.

torch.fx cannot trace a HuggingFace model's ``forward`` (input checks, caches, mask building),
but training needs little of it: embeddings, the blocks one after the other, the head. This
module declares that as the model's ``pipeline_units`` (see
:func:`pipetrain.stages.split.declared_units`): small modules holding the HF model's *own*
submodules, so that cutting, training and ``--save`` work on the HF model itself and its state
dict (``StagedModel.merge_state_dict``, or the model after training) loads back into the HF class
with ``strict=True``.

A batch's ``x`` is what a user of HF passes: the token ids alone, or a dict of HF's argument names,
``{"input_ids", "attention_mask"}`` (1 for tokens, 0 for padding, as a tokenizer's ``padding=True``
gives it; BERT's also ``"token_type_ids"``). With a dict, the embeddings hand the blocks
``{"hidden", "attention_mask"}``, the raw mask (integer or bool: no gradient) travelling beside the
hidden states; each block builds its attention mask from it with HF's own
``create_causal_mask`` (GPT-2) / ``create_bidirectional_mask`` (BERT), as the HF model builds it once
for all its blocks, so no float mask crosses a stage. Any other ``x`` is refused naming the forms
taken. The units compute bit for bit what the HF model computes, with and without padding (tested;
under eager attention as GPT-2 computes with ``use_cache=False``).

The output head of both reuses the input embedding's weight (tied weights): cut into stages, the
first and the last stage hold it, and the synchronous schedules sum its gradient
(:mod:`pipetrain.execution.tied_gradients`). The encoder-decoders T5 and BART are cut at every layer of both
stacks (:mod:`pipetrain.models.hf_seq2seq`); their embedding is shared by the encoder, the decoder
and the LM head.

``transformers`` is an optional dependency (``pip install "pipetrain[hf]"``, transformers>=5); the factories build a
model from a config with random weights, sized by the data (``--model
pipetrain.models.hf:gpt2:n_layer=4``)::

    >>> model = gpt2(input_shape=(64,), num_classes=96, n_layer=2, n_embd=64, n_head=4)
    >>> [name for name, _ in model.pipeline_units]
    ['embed', 'h0', 'h1', 'head']
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError, option
from pipetrain.models.hf_seq2seq import bart_units, t5_units
from pipetrain.models.loss import CrossEntropy

__all__ = ["bart", "bert_mlm", "bert_units", "declare_units", "gpt2", "gpt2_units", "t5"]


def _transformers() -> Any:
    try:
        import transformers  # optional (pipetrain[hf]): imported when an HF model is asked for
    except ImportError:
        raise ConfigError(
            "the HuggingFace models need the transformers package: pip install 'pipetrain[hf]' (transformers>=5)"
        ) from None
    return transformers


_GPT2_KEYS = ("input_ids", "attention_mask")
_BERT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _lm_inputs(x: Any, keys: Sequence[str], model: str) -> dict[str, torch.Tensor]:
    """A batch's ``x`` as HF's keyword arguments: token ids alone, or a dict of the names in ``keys``
    (what HF's tokenizer gives and the model's ``forward`` takes); anything else is refused naming both."""
    forms = (f"{model}'s units take x as token ids (a tensor (B, T)) or a dict of HF's arguments "
             f"{{{', '.join(repr(k) for k in keys)}}} ('input_ids' required; 1 in 'attention_mask' for tokens, "
             f"0 for padding)")
    if isinstance(x, torch.Tensor):
        return {"input_ids": x}
    if isinstance(x, (tuple, list)):  # a list reaches the first unit as the tuple of its items
        raise ConfigError(f"{forms}; got a tuple or list of {len(x)}")
    if not isinstance(x, dict):
        raise ConfigError(f"{forms}; got a {type(x).__name__}")
    unknown = [repr(k) for k in x if k not in keys]
    if unknown or "input_ids" not in x:
        raise ConfigError(f"{forms}; got a dict " + (f"with also {', '.join(unknown)}" if unknown else
                                                     "without 'input_ids'"))
    return dict(x)


def _attention_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> Any:
    """A layer's attention mask from the batch's raw one, as the HF model builds it once for all
    its layers (``create_causal_mask`` / ``create_bidirectional_mask``: None where the attention
    kernel needs none, full-length sequences under SDPA)."""
    # transformers is optional (see _transformers); an HF model imported it already
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    if causal:
        return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=mask, cache=None)
    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)


def _state(inputs: dict[str, torch.Tensor], hidden: torch.Tensor, x: Any) -> Any:
    """What the embeddings hand the first block: the hidden states alone for token ids given alone,
    else a dict with the raw attention mask beside them (integer or bool: no gradient)."""
    if isinstance(x, torch.Tensor):
        return hidden
    return {"hidden": hidden, **({"attention_mask": inputs["attention_mask"]} if "attention_mask" in inputs else {})}


def _hidden(state: Any) -> torch.Tensor:
    """The hidden states a unit was handed, alone or in ``{"hidden", "attention_mask"}``."""
    return state["hidden"] if isinstance(state, dict) else state


class Block(nn.Module):
    """One HF transformer block (no cache), on the hidden states alone or on ``{"hidden",
    "attention_mask"}``: it builds its attention mask from the raw one with HF's own helper, so no
    float mask crosses a stage; takes the hidden states out of the tuple older transformers
    versions return."""

    def __init__(self, block: nn.Module, config: Any, causal: bool) -> None:
        super().__init__()
        self.block = block
        self.config, self.causal = config, causal

    def forward(self, state: Any) -> Any:
        hidden = _hidden(state)
        raw = state.get("attention_mask") if isinstance(state, dict) else None
        out = self.block(hidden, attention_mask=_attention_mask(self.config, hidden, raw, self.causal))
        out = out[0] if isinstance(out, tuple) else out
        return {**state, "hidden": out} if isinstance(state, dict) else out


class GPT2Embeddings(nn.Module):
    """GPT-2's input: token plus position embeddings, then dropout (GPT2Model.forward's start;
    positions 0 ... T-1 whatever the padding, as there)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, x: Any) -> Any:
        inputs = _lm_inputs(x, _GPT2_KEYS, "GPT-2")
        input_ids = inputs["input_ids"]
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        return _state(inputs, self.drop(self.wte(input_ids) + self.wpe(positions)), x)


class GPT2Head(nn.Module):
    """The final layer norm and the LM head (whose weight is the token embedding's)."""

    def __init__(self, transformer: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def forward(self, state: Any) -> torch.Tensor:
        return self.lm_head(self.ln_f(_hidden(state)))


class BertEmbeddings(nn.Module):
    """BERT's embeddings (words, positions, token types: zeros unless the batch gives
    ``token_type_ids``, norm, dropout)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: Any) -> Any:
        inputs = _lm_inputs(x, _BERT_KEYS, "BERT")
        hidden = self.embeddings(input_ids=inputs["input_ids"], token_type_ids=inputs.get("token_type_ids"))
        return _state(inputs, hidden, x)


class BertHead(nn.Module):
    """The masked-LM head (transform, then the decoder tied to the word embeddings)."""

    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, state: Any) -> torch.Tensor:
        return self.cls(_hidden(state))


def gpt2_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``GPT2LMHeadModel``: ``embed``, ``h0`` ... ``h{L-1}``, ``head``."""
    transformer = model.transformer
    blocks = [(f"h{i}", Block(block, transformer.config, causal=True)) for i, block in enumerate(transformer.h)]
    return [("embed", GPT2Embeddings(transformer)), *blocks, ("head", GPT2Head(transformer, model.lm_head))]


def bert_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``BertForMaskedLM``: ``embed``, ``layer0`` ... ``layer{L-1}``, ``head``."""
    bert = model.bert
    if getattr(bert, "pooler", None) is not None:
        raise ConfigError("a BERT with a pooler is not a masked LM's encoder: build BertForMaskedLM")
    causal = bool(getattr(bert.config, "is_decoder", False))  # as BertModel picks its mask
    layers = [(f"layer{i}", Block(layer, bert.config, causal)) for i, layer in enumerate(bert.encoder.layer)]
    return [("embed", BertEmbeddings(bert.embeddings)), *layers, ("head", BertHead(model.cls))]


def declare_units(model: nn.Module, units: Sequence[tuple[str, nn.Module]], loss: Any = None) -> nn.Module:
    """Give ``model`` its pipeline units (and a loss, ``pipeline_loss``); returns ``model``."""
    object.__setattr__(model, "pipeline_units", list(units))
    if loss is not None:
        object.__setattr__(model, "pipeline_loss", loss)
    return model


def _length(input_shape: Sequence[int], seq2seq: bool = False) -> int:
    """The sequence length of samples of token ids, or an error saying what the model takes."""
    if len(input_shape) != 1:
        takes = ("an encoder-decoder takes token ids of shape (T,) per sample (x = {'input_ids': ..., "
                 "'decoder_input_ids': ...}), got samples whose first tensor has shape" if seq2seq else
                 "the HuggingFace language models take token ids of shape (T,) per sample, got samples of shape")
        advice = "" if seq2seq else f": use a text data set such as {option('data', 'text')}"
        raise ConfigError(f"{takes} {tuple(input_shape)}{advice}")
    return int(input_shape[0])


def gpt2(
    input_shape: Sequence[int],
    num_classes: int,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
    shift: bool = False,
    **config: Any,
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` for ``num_classes`` tokens and sequences of
    ``input_shape[0]``, with its pipeline units and its loss.

    ``dropout`` sets GPT-2's three dropout probabilities (HF's default is 0.1; with dropout the
    masks a pipeline draws differ from a single process's). The loss is the cross entropy of the
    logits against targets that are the next tokens (the ``text`` data), or with ``shift=true``
    against targets equal to the inputs, shifted inside the loss as ``labels=input_ids`` is in HF.
    Further options go to ``GPT2Config``.
    """
    transformers = _transformers()
    settings = dict(vocab_size=num_classes, n_positions=_length(input_shape), n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                    bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config}))
    return declare_units(model, gpt2_units(model), CrossEntropy(shift=1 if shift else 0))


def bert_mlm(
    input_shape: Sequence[int],
    num_classes: int,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    dropout: float = 0.0,
    **config: Any,
) -> nn.Module:
    """A randomly initialised ``BertForMaskedLM`` for ``num_classes`` tokens and sequences of
    ``input_shape[0]``, with its pipeline units and its loss: the cross entropy over the targets
    that are not -100 (the masked positions), as BERT's own loss. Further options go to
    ``BertConfig``."""
    transformers = _transformers()
    settings = dict(vocab_size=num_classes, max_position_embeddings=_length(input_shape),
                    num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                    hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
                    hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**{**settings, **config}))
    return declare_units(model, bert_units(model), CrossEntropy())


def t5(
    input_shape: Sequence[int],
    num_classes: int,
    num_layers: int = 2,
    num_decoder_layers: int | None = None,
    num_heads: int = 4,
    d_model: int = 64,
    d_kv: int | None = None,
    d_ff: int | None = None,
    dropout: float = 0.0,
    **config: Any,
) -> nn.Module:
    """A randomly initialised ``T5ForConditionalGeneration`` for ``num_classes`` tokens, with its
    pipeline units (:func:`pipetrain.models.hf_seq2seq.t5_units`) and its loss: the cross entropy
    over the labels that are not -100, as T5's own. ``x`` is ``{"input_ids", "decoder_input_ids"}``
    (and optionally the attention masks) or ``(input_ids, decoder_input_ids)``; ``input_shape`` is
    the shape of ``input_ids`` per sample. Token 0 is the padding and decoder start token, as in T5.
    ``dropout`` sets T5's ``dropout_rate`` (HF's default is 0.1). The config says ``use_cache=False``:
    the units keep no cache, and ``model(..., labels=y)`` then computes bit for bit what they
    compute (with HF's default cache its decoder's attention rounds differently, about 1e-6).
    Further options go to ``T5Config``."""
    transformers = _transformers()
    _length(input_shape, seq2seq=True)
    settings = dict(vocab_size=num_classes, d_model=d_model, d_kv=d_kv or d_model // num_heads, d_ff=d_ff or 4 * d_model,
                    num_layers=num_layers, num_decoder_layers=num_decoder_layers or num_layers, num_heads=num_heads,
                    dropout_rate=dropout, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1,
                    use_cache=False)  # training keeps no cache; with one, HF's decoder rounds differently
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**{**settings, **config}))
    return declare_units(model, t5_units(model), CrossEntropy())


def bart(
    input_shape: Sequence[int],
    num_classes: int,
    encoder_layers: int = 2,
    decoder_layers: int | None = None,
    attention_heads: int = 4,
    d_model: int = 64,
    ffn_dim: int | None = None,
    dropout: float = 0.0,
    max_position_embeddings: int | None = None,
    **config: Any,
) -> nn.Module:
    """A randomly initialised ``BartForConditionalGeneration`` for ``num_classes`` tokens, with its
    pipeline units (:func:`pipetrain.models.hf_seq2seq.bart_units`) and its loss (the cross entropy
    over the labels that are not -100). ``x`` as for :func:`t5`; positions up to
    ``max_position_embeddings`` (default: the sample length ``input_shape[0]``, at least 64). Token 0
    is the padding and decoder start token. ``dropout`` sets BART's dropouts (HF's default is 0.1).
    Further options go to ``BartConfig``."""
    transformers = _transformers()
    length = _length(input_shape, seq2seq=True)
    settings = dict(vocab_size=num_classes, d_model=d_model, encoder_layers=encoder_layers,
                    decoder_layers=decoder_layers or encoder_layers, encoder_attention_heads=attention_heads,
                    decoder_attention_heads=attention_heads, encoder_ffn_dim=ffn_dim or 4 * d_model,
                    decoder_ffn_dim=ffn_dim or 4 * d_model, dropout=dropout, attention_dropout=dropout,
                    activation_dropout=dropout, max_position_embeddings=max_position_embeddings or max(length, 64),
                    pad_token_id=0, decoder_start_token_id=0, bos_token_id=0, eos_token_id=1, forced_eos_token_id=None)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**{**settings, **config}))
    return declare_units(model, bart_units(model), CrossEntropy())
