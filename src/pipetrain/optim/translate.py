"""Translation of momentum-SGD hyper-parameters from a reference batch size to batch size 1."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["TranslatedHyperparameters", "translate_hyperparameters"]


@dataclass(frozen=True)
class TranslatedHyperparameters:
    """Momentum-SGD settings for ``batch_size`` samples per update."""

    lr: float
    momentum: float
    weight_decay: float
    batch_size: int = 1

    def spec(self) -> str:
        """The optimizer spec string, e.g. ``sgd:lr=6.428e-06,momentum=0.999177...``."""
        return (
            f"sgd:lr={self.lr!r},momentum={self.momentum!r},weight_decay={self.weight_decay!r}"
        )


def translate_hyperparameters(
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float = 0.0,
    *,
    target_batch_size: int = 1,
) -> TranslatedHyperparameters:
    """Settings for ``target_batch_size`` (default 1) equal in effect to (lr, momentum) at B.

    Keeps the momentum memory measured in samples (``m_b**(1/b) = m_B**(1/B)``) and the update
    size per sample in steady state (``lr_b/(b*(1 - m_b)) = lr_B/(B*(1 - m_B))``), for losses
    averaged over the batch. For ``target_batch_size = 1``:
    ``m1 = m_B**(1/B)``, ``lr1 = lr_B*(1 - m1)/(B*(1 - m_B))``. Weight decay is unchanged.
    (B=128, lr=0.1, m=0.9) -> (lr 6.428e-06, momentum 0.999177).
    """
    if batch_size < 1 or target_batch_size < 1:
        raise ConfigError(
            f"batch sizes must be >= 1, got reference {batch_size} and target {target_batch_size}"
        )
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"momentum={momentum} must lie in [0, 1) to be translated")
    if not lr >= 0.0:
        raise ConfigError(f"lr={lr} must be >= 0")
    new_momentum = momentum ** (target_batch_size / batch_size)
    new_lr = lr * target_batch_size * (1.0 - new_momentum) / (batch_size * (1.0 - momentum))
    return TranslatedHyperparameters(
        lr=new_lr, momentum=new_momentum, weight_decay=weight_decay, batch_size=target_batch_size
    )
