"""HuggingFace GPT-2 and BERT as pipelines: the HF model, cut between units that share its modules.

torch.fx cannot trace a HuggingFace model's ``forward`` (input checks, caches, mask building),
but training needs little of it: embeddings, the blocks one after the other, the head. This
module declares that as the model's ``pipeline_units`` (see
:func:`pipetrain.stages.split.declared_units`): small modules holding the HF model's *own*
submodules, so that cutting, training and ``--save`` work on the HF model itself and its state
dict (``StagedModel.merge_state_dict``, or the model after training) loads back into the HF class
with ``strict=True``. Without attention masks (every sequence of a batch full length) the units
compute bit for bit what the HF model computes (tested): GPT-2's attention is causal, BERT's
bidirectional.

The output head of both reuses the input embedding's weight (tied weights): cut into stages, the
first and the last stage hold it, and the synchronous schedules sum its gradient
(:mod:`pipetrain.execution.tied`).

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

from pipetrain.errors import ConfigError
from pipetrain.models.loss import CrossEntropy

__all__ = ["bert_mlm", "bert_units", "declare_units", "gpt2", "gpt2_units"]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the HuggingFace models need the transformers package: pip install 'pipetrain[hf]' (transformers>=5)"
        ) from None
    return transformers


class Block(nn.Module):
    """One HF transformer block called on the hidden states alone (no mask, no cache); takes the
    hidden states out of the tuple older transformers versions return."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class GPT2Embeddings(nn.Module):
    """GPT-2's input: token plus position embeddings, then dropout (GPT2Model.forward's start)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2Head(nn.Module):
    """The final layer norm and the LM head (whose weight is the token embedding's)."""

    def __init__(self, transformer: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class BertEmbeddings(nn.Module):
    """BERT's embeddings (words, positions, token types of zeros, norm, dropout)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids)


class BertHead(nn.Module):
    """The masked-LM head (transform, then the decoder tied to the word embeddings)."""

    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls(hidden)


def gpt2_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``GPT2LMHeadModel``: ``embed``, ``h0`` ... ``h{L-1}``, ``head``."""
    transformer = model.transformer
    blocks = [(f"h{i}", Block(block)) for i, block in enumerate(transformer.h)]
    return [("embed", GPT2Embeddings(transformer)), *blocks, ("head", GPT2Head(transformer, model.lm_head))]


def bert_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a ``BertForMaskedLM``: ``embed``, ``layer0`` ... ``layer{L-1}``, ``head``."""
    bert = model.bert
    if getattr(bert, "pooler", None) is not None:
        raise ConfigError("a BERT with a pooler is not a masked LM's encoder: build BertForMaskedLM")
    layers = [(f"layer{i}", Block(layer)) for i, layer in enumerate(bert.encoder.layer)]
    return [("embed", BertEmbeddings(bert.embeddings)), *layers, ("head", BertHead(model.cls))]


def declare_units(model: nn.Module, units: Sequence[tuple[str, nn.Module]], loss: Any = None) -> nn.Module:
    """Give ``model`` its pipeline units (and a loss, ``pipeline_loss``); returns ``model``."""
    object.__setattr__(model, "pipeline_units", list(units))
    if loss is not None:
        object.__setattr__(model, "pipeline_loss", loss)
    return model


def _length(input_shape: Sequence[int]) -> int:
    if len(input_shape) != 1:
        raise ConfigError(
            f"the HuggingFace language models take token ids of shape (T,) per sample, got samples of shape "
            f"{tuple(input_shape)}: use a text data set such as --data text"
        )
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
