"""Delay compensation for pipelined training: Spike Compensation and Linear Weight Prediction.

Both follow Kosson et al., "Pipelined Backpropagation at Scale" (MLSys 2021), with PyTorch-style
momentum ``v <- m*v + g``. At pipeline stage s the gradient applied at update n was computed on
weights D updates old (D = D_s = 2(S-1-s) for Pipelined Backpropagation).

* **Spike Compensation (SC)**: ``w <- w - lr*(a*v + b*g)`` with ``a = m**D`` and
  ``b = (1 - m**D)/(1 - m)``. Plain momentum spreads one gradient over the updates as
  ``lr*(1, m, m**2, ...)``; with delay D the first D terms come too late, so SC applies their sum
  ``b`` at once as a spike and scales the tail by ``a``. The impulse response becomes the
  undelayed one shifted by D (lr=1, m=0.9, D=4: 4.0951, 4.6856, 5.2170, ... -> 10). D=0 is plain
  momentum, D=1 is exactly Nesterov momentum. The update is done in
  :class:`~pipetrain.optim.sgd.SGD`.
* **Linear Weight Prediction (LWP)**: the forward pass reads ``w_hat = w - lr*T*v`` (horizon T,
  default D): a guess of the weights at the time the gradient will be applied. See
  :meth:`~pipetrain.optim.base.StageOptimizer.predict`.
"""

from __future__ import annotations

from typing import Iterable

from pipetrain.errors import ConfigError

__all__ = ["COMPENSATIONS", "spike_coefficients", "parse_compensation"]

#: Valid compensation names.
COMPENSATIONS = ("sc", "lwp")


def spike_coefficients(momentum: float, delay: float) -> tuple[float, float]:
    """``(a, b) = (m**D, (1 - m**D)/(1 - m))``, the weights of ``v`` and ``g`` in an SC update.

    ``b`` is the sum of the first D terms of the momentum response ``1 + m + ... + m**(D-1)``;
    ``D`` may be fractional. ``m = 1`` gives ``(1, D)``, the limit.
    """
    if not delay >= 0:
        raise ConfigError(f"spike compensation delay D={delay} must be >= 0")
    if not 0.0 <= momentum <= 1.0:
        raise ConfigError(f"spike compensation needs 0 <= momentum <= 1, got {momentum}")
    a = momentum**delay
    if momentum == 1.0:
        return a, float(delay)
    return a, (1.0 - a) / (1.0 - momentum)


def parse_compensation(value: str | Iterable[str] | None) -> frozenset[str]:
    """``"none"``, ``"sc"``, ``"lwp"``, ``"sc+lwp"`` (or an iterable of names) -> a set of names."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        parts = [] if value.strip().lower() in ("", "none") else value.split("+")
    else:
        parts = list(value)
    names = frozenset(part.strip().lower() for part in parts)
    unknown = sorted(names - set(COMPENSATIONS))
    if unknown:
        raise ConfigError(
            f"unknown delay compensation {', '.join(map(repr, unknown))}; valid: none, sc, lwp, "
            "sc+lwp"
        )
    return names
