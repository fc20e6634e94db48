"""HuggingFace encoder-decoders (T5, BART) as pipelines: units at layer boundaries, the encoder's
output and the masks travelling through the decoder's stages.

A model cut only between its encoder and its decoder gives two stages however many layers it has.
These units cut it at every layer: ``embed``, ``encoder0`` ... ``encoder{L-1}``, ``decoder_embed``
(what ends the encoder, T5's final norm, and the decoder's embeddings), ``decoder0`` ...
``decoder{L-1}``, ``head``. Between units travels a dict of tensors (:mod:`pipetrain.structure`):
``hidden``, the raw ``attention_mask`` / ``decoder_attention_mask`` a batch gave (integer or bool:
no gradient), ``decoder_input_ids`` until the decoder embeds them, then
``encoder_hidden_states``, and T5's ``position_bias`` (made by the first layer of each stack from
its relative attention bias, so it carries a gradient) and ``encoder_decoder_position_bias`` (zeros:
a constant). Each layer builds its attention masks from the raw ones with HF's own functions
(``create_bidirectional_mask``, ``create_causal_mask``), as the HF stack builds them once, so no
float mask crosses a stage; the units call the HF model's own modules, and compute bit for bit what
``model(..., labels=y)`` computes (tested, with and without padding masks; T5 with
``use_cache=False``, as :func:`pipetrain.models.hf.t5` builds it). Not supported: caches
(training needs none) and ``inputs_embeds``.

A batch's ``x`` is a dict of HF's argument names, ``{"input_ids", "decoder_input_ids"}`` and
optionally ``"attention_mask"``, ``"decoder_attention_mask"`` (1 for tokens, 0 for padding), or the
tuple ``(input_ids, decoder_input_ids)``; ``y`` the labels (-100 where nothing counts). As in HF,
``decoder_input_ids`` are the labels shifted right behind the decoder start token
(``model.prepare_decoder_input_ids_from_labels(labels)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.errors import ConfigError

__all__ = ["bart_units", "seq2seq_inputs", "t5_units"]

_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def seq2seq_inputs(x: Any) -> dict[str, torch.Tensor]:
    """A batch's ``x`` as HF's keyword arguments (see the module docstring), checked."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return {"input_ids": x[0], "decoder_input_ids": x[1]}
    if not isinstance(x, dict):
        raise ConfigError(
            f"an encoder-decoder takes x = {{'input_ids': ..., 'decoder_input_ids': ...}} (also 'attention_mask', "
            f"'decoder_attention_mask') or (input_ids, decoder_input_ids), got {type(x).__name__}"
            + (f" of length {len(x)}" if isinstance(x, (tuple, list)) else "")
        )
    unknown = [k for k in x if k not in _KEYS]
    if unknown:
        raise ConfigError(f"an encoder-decoder's x takes the keys {', '.join(_KEYS)}; got also {', '.join(unknown)}")
    missing = [k for k in ("input_ids", "decoder_input_ids") if k not in x]
    if missing:
        raise ConfigError(
            f"an encoder-decoder's x lacks {' and '.join(missing)}: give the decoder its inputs, the labels shifted "
            f"right (model.prepare_decoder_input_ids_from_labels(labels)), as HF computes them from labels="
        )
    return dict(x)


def _masks(config: Any, hidden: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """A decoder layer's self-attention and cross-attention masks, as the HF decoder stack builds
    them (from the raw masks and the shape, dtype and device of ``hidden``)."""
    # transformers is optional (pipetrain[hf]); the HF model imported it already
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=state.get("decoder_attention_mask"),
                              cache=None)
    cross = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=state.get("attention_mask"),
                                      encoder_hidden_states=state["encoder_hidden_states"])
    return mask, cross


def _encoder_mask(config: Any, hidden: torch.Tensor, state: dict[str, torch.Tensor]) -> Any:
    from transformers.masking_utils import create_bidirectional_mask  # optional, as in _masks

    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=state.get("attention_mask"))


def _start(x: Any, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state after the encoder's embeddings: ``hidden`` and the batch's other inputs."""
    inputs = seq2seq_inputs(x)
    state = {"hidden": hidden}
    for key in ("attention_mask", "decoder_input_ids", "decoder_attention_mask"):
        if key in inputs:
            state[key] = inputs[key]
    return state


def _decoding(state: dict[str, torch.Tensor], encoded: torch.Tensor, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state after the decoder's embeddings: the encoder's output beside the decoder's hidden states."""
    out = {"hidden": hidden, "encoder_hidden_states": encoded}
    for key in ("attention_mask", "decoder_attention_mask"):
        if key in state:
            out[key] = state[key]
    return out


class _StackLayer(nn.Module):
    """One layer of an HF stack, with what the stack's ``forward`` gives it: its config (for the
    masks) and its LayerDrop probability."""

    def __init__(self, stack: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.config, self.layerdrop = stack.config, getattr(stack, "layerdrop", 0.0)


# -- T5 ------------------------------------------------------------------------------------------


class T5Embed(nn.Module):
    """The encoder's token embeddings and dropout (T5Stack.forward's start)."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.dropout = stack.embed_tokens, stack.dropout

    def forward(self, x: Any) -> dict[str, torch.Tensor]:
        inputs = seq2seq_inputs(x)
        return _start(inputs, self.dropout(self.embed_tokens(inputs["input_ids"])))


class T5EncoderLayer(_StackLayer):
    """One encoder ``T5Block``; the first makes the position bias the others reuse."""

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = state["hidden"]
        mask = _encoder_mask(self.config, hidden, state)
        hidden, bias, _ = self.layer(hidden, mask, state.get("position_bias"), None, None, None, cache=None)
        return {**state, "hidden": hidden, "position_bias": bias}


class T5DecoderEmbed(nn.Module):
    """The encoder's final norm and dropout, then the decoder's token embeddings and dropout."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.final_layer_norm, self.encoder_dropout = encoder.final_layer_norm, encoder.dropout
        self.embed_tokens, self.dropout = decoder.embed_tokens, decoder.dropout

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoded = self.encoder_dropout(self.final_layer_norm(state["hidden"]))
        return _decoding(state, encoded, self.dropout(self.embed_tokens(state["decoder_input_ids"])))


class T5DecoderLayer(_StackLayer):
    """One decoder ``T5Block`` (self-attention, cross-attention to the encoder's output, MLP)."""

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, encoded = state["hidden"], state["encoder_hidden_states"]
        mask, cross = _masks(self.config, hidden, state)
        hidden, bias, cross_bias = self.layer(hidden, mask, state.get("position_bias"), encoded, cross,
                                              state.get("encoder_decoder_position_bias"), cache=None)
        return {**state, "hidden": hidden, "position_bias": bias, "encoder_decoder_position_bias": cross_bias}


class T5Head(nn.Module):
    """The decoder's final norm and dropout, the output scaling of tied embeddings, the LM head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_layer_norm, self.dropout = model.decoder.final_layer_norm, model.decoder.dropout
        self.lm_head = model.lm_head
        self.scale = model.model_dim ** -0.5 if getattr(model.config, "scale_decoder_outputs", False) else None

    def forward(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.dropout(self.final_layer_norm(state["hidden"]))
        if self.scale is not None:
            hidden = hidden * self.scale
        return self.lm_head(hidden)


def t5_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``T5ForConditionalGeneration`` (see the module docstring)."""
    encoder, decoder = model.encoder, model.decoder
    return [
        ("embed", T5Embed(encoder)),
        *[(f"encoder{i}", T5EncoderLayer(encoder, block)) for i, block in enumerate(encoder.block)],
        ("decoder_embed", T5DecoderEmbed(encoder, decoder)),
        *[(f"decoder{i}", T5DecoderLayer(decoder, block)) for i, block in enumerate(decoder.block)],
        ("head", T5Head(model)),
    ]


# -- BART ----------------------------------------------------------------------------------------


def _dropped(stack: nn.Module) -> bool:
    """LayerDrop, as the HF stacks draw it: in training, skip the layer with probability ``layerdrop``."""
    return stack.training and stack.layerdrop > 0.0 and bool(torch.rand([]) < stack.layerdrop)


class BartEmbed(nn.Module):
    """The encoder's scaled token embeddings plus learned positions, layer norm, dropout."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.embed_positions = stack.embed_tokens, stack.embed_positions
        self.layernorm_embedding = stack.layernorm_embedding
        self.p = stack.dropout

    def forward(self, x: Any) -> dict[str, torch.Tensor]:
        inputs = seq2seq_inputs(x)
        embeds = self.embed_tokens(inputs["input_ids"])
        positions = self.embed_positions(embeds[:, :, -1]).to(embeds.device)
        hidden = F.dropout(self.layernorm_embedding(embeds + positions), p=self.p, training=self.training)
        return _start(inputs, hidden)


class BartEncoderLayer(_StackLayer):
    """One ``BartEncoderLayer`` (with the stack's LayerDrop)."""

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = state["hidden"]
        if _dropped(self):
            return state
        return {**state, "hidden": self.layer(hidden, _encoder_mask(self.config, hidden, state))}


class BartDecoderEmbed(BartEmbed):
    """The decoder's scaled token embeddings plus learned positions, layer norm, dropout."""

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = state["decoder_input_ids"]
        embeds = self.embed_tokens(ids)
        positions = self.embed_positions(ids, 0, position_ids=torch.arange(ids.shape[1], device=embeds.device))
        hidden = F.dropout(self.layernorm_embedding(embeds + positions.to(embeds.device)), p=self.p,
                           training=self.training)
        return _decoding(state, state["hidden"], hidden)


class BartDecoderLayer(_StackLayer):
    """One ``BartDecoderLayer`` (with the stack's LayerDrop); without a decoder attention mask the
    stack's own default, ones."""

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if _dropped(self):
            return state
        hidden = state["hidden"]
        given = state
        if state.get("decoder_attention_mask") is None:
            given = {**state, "decoder_attention_mask": torch.ones(hidden.shape[:2], device=hidden.device)}
        mask, cross = _masks(self.config, hidden, given)
        hidden = self.layer(hidden, mask, state["encoder_hidden_states"], encoder_attention_mask=cross, cache=None,
                            use_cache=False)
        return {**state, "hidden": hidden}


class BartHead(nn.Module):
    """The LM head plus the final logits bias."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm_head = model.lm_head
        self.register_buffer("final_logits_bias", model.final_logits_bias)  # the model's own tensor

    def forward(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.lm_head(state["hidden"])
        return logits + self.final_logits_bias.to(logits.device)


def bart_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``BartForConditionalGeneration`` (see the module docstring)."""
    encoder, decoder = model.model.encoder, model.model.decoder
    return [
        ("embed", BartEmbed(encoder)),
        *[(f"encoder{i}", BartEncoderLayer(encoder, layer)) for i, layer in enumerate(encoder.layers)],
        ("decoder_embed", BartDecoderEmbed(decoder)),
        *[(f"decoder{i}", BartDecoderLayer(decoder, layer)) for i, layer in enumerate(decoder.layers)],
        ("head", BartHead(model)),
    ]
