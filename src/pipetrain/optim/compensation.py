"""Delay compensation for pipelined training: SC, LWP, and per-stage rate scaling (DLR, DTS and its variants).

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
* **Delay-scaled learning rate (DLR)**: stage s trains with ``lr_s = c_s * lr``,
  ``c_s = min(1, (D*/D_s)**2)`` (``D*``: the reference delay, ``dlrN`` sets ``D* = N``; default
  :data:`DEFAULT_DLR_DELAY`). Why: on the quadratic model of ``benchmarks/quadratic.py`` the
  largest stable ``h = lr*lam`` of delayed heavy momentum *with the best SC/LWP strengths* falls
  as about ``0.4-1.0/D**2`` (RESULTS.md section 5): compensation moves the bound from
  ``(1-m)/D`` to ``~1/D**2`` but no further, so at a long enough delay no strength of SC or LWP
  keeps a stage stable. Scaling the rate by ``(D*/D_s)**2`` keeps every stage with a delay above
  ``D*`` at the stability margin of a stage with delay ``D*``; stages with ``D_s <= D*`` (the
  last ones, and every stage of a short pipeline) are untouched. It composes with SC and LWP
  (``sc+lwp+dlr``: the spike and the prediction use the stage's scaled rate, like its update).
  The scaling is done by :func:`pipetrain.optim.build_stage_optimizer`.
* **Delay time scaling (DTS)**: a stage whose delay is ``k = D_s/D*`` times the reference delay
  (``dtsN``: ``D* = N``; default :data:`DEFAULT_DTS_DELAY`) trains with ``lr_s = lr/k**2`` *and*
  a momentum memory ``k`` times longer, ``1 - m_s = (1 - m)/k``; stages with ``k <= 1`` are
  untouched. Why: the heavy-ball recurrence with delay D is, up to the discretisation, a delay
  differential equation in which ``h*D**2`` (``h = lr*lam``) and ``(1 - m)*D`` are the only
  numbers; scaling both as above makes the stage with delay ``k*D*`` run the dynamics of the stage
  with delay ``D*`` slowed ``k`` times (SC's ``a = m_s**D`` stays about ``m**D*``, LWP's step
  ``lr*T*v`` the same fraction of the way). So it keeps the margin of the stage at ``D*``, as
  DLR means to, but its effective rate
  ``lr_s/(1 - m_s)`` (what moves a weight along a flat direction) is cut by ``k`` instead of DLR's
  ``k**2``: at S = 64, D* = 4, stage 0 (D = 126) learns at 1/31.5 of the rate instead of 1/992.
  :func:`time_scaled_settings` gives ``(lr factor, m_s)``; done by
  :func:`pipetrain.optim.build_stage_optimizer` (momentum SGD only).
* **Rate-following DTS (DTSF)**, ``dtsfN``: DTS with ``k`` recomputed from the lr schedule's
  factor f before every update, ``k = max(1, (D_s/D*)*sqrt(f))`` (:func:`rate_following_settings`).
  DTS keeps D*'s margin at the full rate; a decayed rate needs less scaling for the same margin
  (with SC and LWP the stable ``h`` goes as ``1/D**2``, so ``h*D**2`` is held by ``k**2 ∝ f``), and
  the stages return to SGD's rate and memory as the schedule anneals. Done by
  :class:`pipetrain.optim.sgd.RateFollowingSGD`.
* **Delay time scaling at SGD's temperature (DTT)**, ``dttN``: DTS's rate ``lr/k**2`` with the
  momentum memory ``k**2`` times longer, ``1 - m_s = (1 - m)/k**2`` (:func:`temperature_settings`),
  so that the effective rate ``lr_s/(1 - m_s)`` (how far a weight moves per unit of gradient, and
  the temperature of the gradient noise) is SGD's. Why it stays stable: with SC and LWP the
  largest stable ``h`` hardly depends on the momentum (``h*D**2`` is 0.4-1.0 for any ``m`` near 1,
  RESULTS.md section 5), so the longer memory keeps DTS's margin (within 2 % on the quadratic)
  while DTS's ``k``-fold lower temperature at the deep stages, which costs test accuracy in long
  runs even without any delay (RESULTS.md section 7), is undone. The price: a memory of
  ``k**2/(1 - m)`` updates, under-damped along flat directions.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

from pipetrain.errors import ConfigError, option

__all__ = [
    "COMPENSATIONS",
    "DEFAULT_DLR_DELAY",
    "spike_coefficients",
    "delay_lr_factor",
    "parse_compensation",
    "parse_dlr_delay",
    "DEFAULT_DTS_DELAY",
    "time_scaled_settings",
    "parse_dts_delay",
    "rate_following_settings",
    "parse_dtsf_delay",
    "temperature_settings",
    "parse_dtt_delay",
    "refuse_other_than_sgd",
]

#: Valid compensation names.
COMPENSATIONS = ("sc", "lwp", "dlr", "dts", "dtsf", "dtt")

#: DLR's reference delay D* when ``dlr`` is named without one: the best of 8, 16 and 30 in the
#: S = 32 and 64 study of benchmarks/RESULTS.md section 7 (the module docstring says why).
DEFAULT_DLR_DELAY = 8.0

#: DTS's reference delay D* when ``dts`` is named without one: the better of 4 and 8 in the
#: S = 32 and 64 study of benchmarks/RESULTS.md section 7 (8 is unstable at S = 64, lr x2)
DEFAULT_DTS_DELAY = 4.0

_DLR = re.compile(r"^dlr(\d+(?:\.\d*)?|\.\d+)?$")
_DTS = re.compile(r"^dts(\d+(?:\.\d*)?|\.\d+)?$")
_DTSF = re.compile(r"^dtsf(\d+(?:\.\d*)?|\.\d+)?$")
_DTT = re.compile(r"^dtt(\d+(?:\.\d*)?|\.\d+)?$")
_VALID = ("none, sc, lwp, dlr or dlrN, dts or dtsN, dtsf or dtsfN, dtt or dttN (N: the reference delay D*), "
          "joined by '+' (e.g. sc+lwp+dlr16, sc+lwp+dts4, sc+lwp+dtt4)")


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


def delay_lr_factor(delay: float, reference_delay: float = DEFAULT_DLR_DELAY) -> float:
    """DLR's learning-rate factor ``min(1, (D*/D)**2)`` of a stage with delay ``D``.

    Exactly 1.0 for ``D <= D*`` (so such a stage computes what it would without DLR, bit for bit).
    """
    if not delay >= 0:
        raise ConfigError(f"delay-scaled learning rate: delay D={delay} must be >= 0")
    if not reference_delay > 0:
        raise ConfigError(f"delay-scaled learning rate: reference delay D*={reference_delay} must be > 0")
    if delay <= reference_delay:
        return 1.0
    return (reference_delay / delay) ** 2


def refuse_other_than_sgd(name: str, optimizer: str) -> None:
    """DTS, DTSF and DTT (``name``) change a stage's momentum: refuse ``optimizer`` unless it is
    momentum SGD, saying what to use instead."""
    if optimizer != "sgd":
        what = "rate-following delay time scaling" if name == "dtsf" else "delay time scaling"
        raise ConfigError(
            f"{what} ({name}) scales the momentum of momentum SGD, not of {optimizer!r}; use "
            f"{option('optimizer', 'sgd:momentum=...')} with {name}, or dlr (the delay-scaled learning rate) with Adam"
        )


def time_scaled_settings(momentum: float, delay: float,
                         reference_delay: float = DEFAULT_DTS_DELAY) -> tuple[float, float]:
    """DTS's ``(lr factor, momentum)`` of a stage with delay ``D``: ``(1/k**2, 1 - (1 - m)/k)``
    with ``k = D/D*`` (the factor is :func:`delay_lr_factor`'s), and exactly ``(1.0, momentum)``
    for ``D <= D*`` (such a stage computes what it would without DTS, bit for bit)."""
    if not delay >= 0:
        raise ConfigError(f"delay time scaling: delay D={delay} must be >= 0")
    if not reference_delay > 0:
        raise ConfigError(f"delay time scaling: reference delay D*={reference_delay} must be > 0")
    if not 0.0 < momentum < 1.0:
        raise ConfigError(
            f"delay time scaling (dts) lengthens the momentum memory 1/(1-m), so it needs 0 < momentum < 1, "
            f"got {momentum}; use dlr (the delay-scaled learning rate) without momentum"
        )
    if delay <= reference_delay:
        return 1.0, momentum
    # the rate factor is DLR's: DTS is DLR with the momentum memory lengthened
    return delay_lr_factor(delay, reference_delay), 1.0 - (1.0 - momentum) / (delay / reference_delay)


def rate_following_settings(momentum: float, delay: float, factor: float,
                            reference_delay: float = DEFAULT_DTS_DELAY) -> tuple[float, float]:
    """Rate-following DTS's ``(lr factor, momentum)`` of a stage with delay ``D`` while the lr
    schedule's factor is ``f``: DTS's settings for ``k = max(1, (D/D*)*sqrt(f))`` instead of
    ``D/D*``. The lr factor multiplies the *scheduled* rate ``f*lr``.

    Why ``sqrt(f)``: with SC and LWP the largest stable ``h = lr*lam`` falls as about ``1/D**2``
    (RESULTS.md section 5), so at the scheduled rate ``f*lr`` a stage keeps D*'s margin with
    ``k**2 = f*(D/D*)**2``: the stage's own rate ``f*lr/k**2 = lr*(D*/D)**2`` stays DTS's while the
    schedule decays, and its momentum memory shortens back to SGD's as ``sqrt(f)``. ``f = 1`` is
    :func:`time_scaled_settings` exactly; ``k <= 1`` (``D <= D*``, or ``f <= (D*/D)**2``) is
    exactly ``(1.0, momentum)``.
    """
    if not factor >= 0:
        raise ConfigError(f"rate-following delay time scaling: lr schedule factor {factor} must be >= 0")
    if factor == 1.0:
        return time_scaled_settings(momentum, delay, reference_delay)
    fast, _ = time_scaled_settings(momentum, delay, reference_delay)  # checks the arguments
    if fast == 1.0:
        return 1.0, momentum
    k = delay / reference_delay * math.sqrt(factor)
    if k <= 1.0:
        return 1.0, momentum
    return 1.0 / (k * k), 1.0 - (1.0 - momentum) / k


def temperature_settings(momentum: float, delay: float,
                         reference_delay: float = DEFAULT_DTS_DELAY) -> tuple[float, float]:
    """DTT's ``(lr factor, momentum)`` of a stage with delay ``D``: ``(1/k**2, 1 - (1 - m)/k**2)``
    with ``k = D/D*`` (the factor is :func:`delay_lr_factor`'s), and exactly ``(1.0, momentum)``
    for ``D <= D*``. The effective rate ``lr_s/(1 - m_s)``, and with it the gradient-noise
    temperature of the stage, is SGD's ``lr/(1 - m)``; DTS's is ``k`` times lower."""
    factor, _ = time_scaled_settings(momentum, delay, reference_delay)  # checks the arguments
    if factor == 1.0:
        return 1.0, momentum
    k = delay / reference_delay
    return factor, 1.0 - (1.0 - momentum) / k**2


def _parts(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [] if value.strip().lower() in ("", "none") else [p.strip().lower() for p in value.split("+")]
    return [str(p).strip().lower() for p in value]


def parse_compensation(value: str | Iterable[str] | None) -> frozenset[str]:
    """``"none"``, ``"sc"``, ``"lwp"``, ``"sc+lwp"``, ``"sc+lwp+dlr16"`` (or an iterable of names)
    -> a set of names (``dlrN`` counts as ``dlr``; :func:`parse_dlr_delay` reads its N)."""
    names = set()
    for part in _parts(value):
        if _DLR.match(part):
            part = "dlr"
        elif _DTS.match(part):
            part = "dts"
        elif _DTSF.match(part):
            part = "dtsf"
        elif _DTT.match(part):
            part = "dtt"
        if part in names:
            raise ConfigError(f"delay compensation {value!r} names {part} twice; valid: {_VALID}")
        names.add(part)
    unknown = sorted(names - set(COMPENSATIONS))
    if unknown:
        raise ConfigError(f"unknown delay compensation {', '.join(map(repr, unknown))}; valid: {_VALID}")
    scaled = sorted(names & {"dlr", "dts", "dtsf", "dtt"})
    if len(scaled) > 1:
        raise ConfigError(
            f"delay compensation {value!r} names both {scaled[0]} and {scaled[1]}; each scales every stage's rate "
            "by its delay (dts, dtsf and dtt also its momentum): name one of them"
        )
    return frozenset(names)


def _reference_delay(value: str | Iterable[str] | None, pattern: re.Pattern, default: float,
                     example: str) -> float | None:
    for part in _parts(value):
        match = pattern.match(part)
        if match:
            delay = default if match.group(1) is None else float(match.group(1))
            if not delay > 0:
                raise ConfigError(
                    f"delay compensation {part!r}: the reference delay D* must be > 0 (e.g. {example})"
                )
            return delay
    return None


def parse_dlr_delay(value: str | Iterable[str] | None) -> float | None:
    """DLR's reference delay D* named in a compensation (``dlr16`` -> 16.0, ``dlr`` -> the
    default), or None when DLR is off."""
    return _reference_delay(value, _DLR, DEFAULT_DLR_DELAY, "dlr16")


def parse_dts_delay(value: str | Iterable[str] | None) -> float | None:
    """DTS's reference delay D* named in a compensation (``dts4`` -> 4.0, ``dts`` -> the
    default), or None when DTS is off."""
    return _reference_delay(value, _DTS, DEFAULT_DTS_DELAY, "dts4")


def parse_dtsf_delay(value: str | Iterable[str] | None) -> float | None:
    """Rate-following DTS's reference delay D* named in a compensation (``dtsf4`` -> 4.0,
    ``dtsf`` -> DTS's default), or None when it is off."""
    return _reference_delay(value, _DTSF, DEFAULT_DTS_DELAY, "dtsf4")


def parse_dtt_delay(value: str | Iterable[str] | None) -> float | None:
    """DTT's reference delay D* named in a compensation (``dtt4`` -> 4.0, ``dtt`` -> DTS's
    default), or None when it is off."""
    return _reference_delay(value, _DTT, DEFAULT_DTS_DELAY, "dtt4")
