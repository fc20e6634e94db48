"""Finding BatchNorm layers, which batch-size-1 pipelines (PB) cannot train."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipetrain.errors import ConfigError, option

__all__ = ["find_batchnorm", "refuse_batchnorm"]


def find_batchnorm(module: nn.Module, *, training_only: bool = False) -> list[str]:
    """Qualified names of the BatchNorm layers in ``module`` ("" for ``module`` itself).

    With ``training_only``, only those in training mode (which take statistics across a batch).
    """
    return [
        name
        for name, child in module.named_modules()
        if isinstance(child, _BatchNorm) and (child.training or not training_only)
    ]


def refuse_batchnorm(module: nn.Module, context: str = "Pipelined Backpropagation") -> None:
    """Raise ConfigError if ``module`` has a BatchNorm layer in training mode."""
    names = find_batchnorm(module, training_only=True)
    if names:
        shown = ", ".join(repr(n or "<model>") for n in names[:5]) + (" ..." if len(names) > 5 else "")
        raise ConfigError(
            f"{context} trains with batch size 1, but the model has {len(names)} BatchNorm "
            f"layer(s) in training mode ({shown}), which need statistics across samples; use "
            f"GroupNorm or LayerNorm instead (e.g. {option('model', 'resmlp:norm=group')} or "
            f"{option('model', 'resnet-gn')}), or "
            f"put the BatchNorm layers in eval mode"
        )
