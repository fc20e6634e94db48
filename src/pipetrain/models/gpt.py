"""`gpt`: a small decoder-only transformer over characters, written as an ordinary nn.Module.

Token and position embeddings, ``n_layer`` pre-norm blocks of causal self-attention and an MLP,
a final LayerNorm and a Linear head to the vocabulary. ``forward(idx)`` takes int64 token ids
``(B, T)`` with ``T <= block_size`` and returns logits ``(B, T, vocab)``; the loss is next-token
cross entropy over all positions (:func:`pipetrain.models.loss.cross_entropy`, which flattens).

Everything traces with torch.fx (no Python control flow on tensor values, attention through
``scaled_dot_product_attention(is_causal=True)``, no buffer sliced by a traced length), so
``split_model(gpt, stages=S)`` or ``split_at=["blocks.2"]`` cuts it anywhere. Dropout is an
``nn.Dropout`` layer (it follows ``train()``/``eval()`` after tracing); it is off by default.

``tie=True`` makes the head reuse the token embedding's weight, as GPT-2 does. Stages cannot share
a parameter, so a tied model can only be split with the embedding and the head in one stage;
the default is untied.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.errors import ConfigError, option
from pipetrain.models.common import check_int

__all__ = ["GPT", "Block", "CausalSelfAttention", "gpt"]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` sees positions ``0..t``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q = q.view(shape).transpose(1, 2)
        k = k.view(shape).transpose(1, 2)
        v = v.view(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``+ mlp(ln2(x))`` (pre-norm residual block)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Character-level GPT: ``wte``, ``wpe``, ``drop``, ``blocks.0..n_layer-1``, ``ln_f``, ``head``.

    Initialisation: weights N(0, 0.02), biases 0, LayerNorm (1, 0), and the two residual output
    projections of each block (``attn.proj``, ``mlp.2``) N(0, 0.02 / sqrt(2 n_layer)).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        tie: bool = False,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * max(n_layer, 1)))
        if tie:
            self.head.weight = self.wte.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        torch._assert(t <= self.block_size, "gpt: the sequence is longer than block_size")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(
    input_shape: Sequence[int] | int,
    num_classes: int,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int | None = None,
    dropout: float = 0.0,
    bias: bool = True,
    tie: bool = False,
) -> GPT:
    """A :class:`GPT` for the data: vocabulary = ``num_classes``, ``block_size`` = sequence length.

    ``input_shape`` is one sample's shape, ``(T,)`` token ids; ``block_size`` defaults to ``T``.
    """
    n_layer = check_int("gpt", "n_layer", n_layer, 1)
    n_head = check_int("gpt", "n_head", n_head, 1)
    n_embd = check_int("gpt", "n_embd", n_embd, 1)
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if len(shape) != 1:
        raise ConfigError(
            f"model gpt reads sequences of token ids, one sample of shape (T,); the data's samples "
            f"have shape {shape} (use {option('data', 'text:...')} or a data set of int64 token sequences)"
        )
    block_size = check_int("gpt", "block_size", shape[0] if block_size is None else block_size, 1)
    if n_embd % n_head:
        raise ConfigError(f"model gpt: n_head={n_head} must divide n_embd={n_embd}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"model gpt: dropout must be in [0, 1), got {dropout!r}")
    return GPT(num_classes, block_size, n_layer, n_head, n_embd, float(dropout), bool(bias), bool(tie))
