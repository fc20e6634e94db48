"""Sampling text from a character model (the unsplit model or its stages), reproducibly."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.errors import ConfigError
from pipetrain.models.metrics import model_modules

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    vocab: Any,
    prompt: str = "\n",
    length: int = 200,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    block_size: int | None = None,
) -> str:
    """``length`` characters sampled after ``prompt`` (the prompt itself is not returned).

    ``model`` maps token ids ``(1, T)`` to logits ``(1, T, V)``: a :class:`~pipetrain.models.GPT`,
    a :class:`~pipetrain.stages.StagedModel` of one, or any such callable. It sees at most the
    last ``block_size`` tokens (default: ``model.block_size``). Each step samples from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely characters when
    given, with a ``torch.Generator`` seeded with ``seed``: the same arguments give the same text.
    Modules run in eval mode (restored afterwards) without gradients.
    """
    block_size = block_size if block_size is not None else getattr(model, "block_size", None)
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("generate: give block_size= (the longest context the model accepts)")
    if not prompt:
        raise ConfigError("generate: the prompt must have at least one character (e.g. '\\n')")
    if not temperature > 0:
        raise ConfigError(f"generate: temperature must be positive, got {temperature!r}")
    if length < 0:
        raise ConfigError(f"generate: length must be >= 0, got {length!r}")
    modules = model_modules(model)
    modes = [[m.training for m in module.modules()] for module in modules]
    for module in modules:
        module.eval()
    generator = torch.Generator().manual_seed(seed)
    idx = vocab.encode(prompt)[None, :]
    out: list[int] = []
    try:
        for _ in range(length):
            logits = model(idx[:, -block_size:])
            logits = logits[0, -1, :].double() / temperature
            if top_k is not None and top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            out.append(int(token))
            idx = torch.cat([idx, token.view(1, 1).to(idx.dtype)], dim=1)
    finally:
        for module, flags in zip(modules, modes):
            for m, flag in zip(module.modules(), flags):
                m.training = flag
    return vocab.decode(out)
