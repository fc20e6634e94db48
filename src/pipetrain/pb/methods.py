"""Training methods of the PB study: names like ``pb+sc0.5+lwp`` and what each one trains.

=================  ===========================================================================
``sgd-batch``      plain minibatch momentum SGD at the reference batch size, lr and momentum
``sgd``            batch-size-1 momentum SGD with the translated lr and momentum, no pipeline
``pb``             Pipelined Backpropagation (batch size 1, translated settings, no compensation)
``pb+sc``          PB with Spike Compensation, delay ``D_s`` at stage s
``pb+lwp``         PB with Linear Weight Prediction, horizon ``D_s``
``pb+sc+lwp``      both, in full
``pb+scA+lwpB``    both with the SC delay ``A*D_s`` and the LWP horizon ``B*D_s`` (e.g.
                   ``pb+sc0.5+lwp0.5``: half of each, since the two together in full can
                   over-correct); ``pb+sc0.5`` or ``pb+lwp2`` alone work the same way
``pb+...+dlr``     adds the delay-scaled learning rate: stage s trains at
                   ``min(1, (D*/D_s)**2)`` times the rate (``dlrN``: ``D* = N``; ``dlr``: the
                   default :data:`~pipetrain.optim.compensation.DEFAULT_DLR_DELAY`), e.g.
                   ``pb+sc0.5+lwp+dlr16``; ``pb+dlr`` alone works too
``pb+...+dts``     adds delay time scaling instead: stage s trains at ``1/k**2`` times the rate
                   with a momentum memory ``k`` times longer, ``k = max(1, D_s/D*)``
                   (``dtsN``: ``D* = N``; ``dts``: the default
                   :data:`~pipetrain.optim.compensation.DEFAULT_DTS_DELAY`), e.g.
                   ``pb+sc+lwp+dts4``; not with ``dlr``
``pb+...+dtsf``    rate-following delay time scaling: DTS while the lr schedule is at its full
                   rate, ``k = max(1, (D_s/D*)*sqrt(f))`` at schedule factor f, so the stages
                   return to SGD's rate and memory as the rate decays (``dtsfN``: ``D* = N``),
                   e.g. ``pb+sc+lwp+dtsf4``; not with ``dlr`` or ``dts``
``pb+...+dtt``     delay time scaling at SGD's temperature: DTS's rate ``1/k**2`` with the
                   momentum memory ``k**2`` times longer, so ``lr/(1-m)`` is SGD's
                   (``dttN``: ``D* = N``), e.g. ``pb+sc+lwp+dtt4``
=================  ===========================================================================

A study's ``--delay-scale`` multiplies the SC and LWP factors once more (a sweep of the
compensation strength); it does not apply to methods without SC or LWP, nor to the ``D*`` of DLR,
DTS, DTSF or DTT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipetrain.errors import ConfigError, option
from pipetrain.optim.compensation import DEFAULT_DLR_DELAY, DEFAULT_DTS_DELAY

__all__ = ["Method", "parse_method", "parse_methods", "DEFAULT_METHODS"]

#: what ``pipetrain pb`` trains when ``--methods`` is not given
DEFAULT_METHODS = ("sgd-batch", "sgd", "pb", "pb+sc", "pb+lwp", "pb+sc+lwp")

_PART = re.compile(r"^(sc|lwp|dlr|dtsf|dts|dtt)(\d+(?:\.\d*)?|\.\d+)?$")


@dataclass(frozen=True)
class Method:
    """One way of training: with or without pipeline, which compensation and how strong."""

    name: str
    pipelined: bool
    batch: bool = False
    sc: float = 0.0  # SC delay as a multiple of the stage delay D_s (0: off)
    lwp: float = 0.0  # LWP horizon as a multiple of D_s (0: off)
    dlr: float = 0.0  # DLR's reference delay D* in samples (0: off)
    dts: float = 0.0  # DTS's reference delay D* in samples (0: off)
    dtsf: float = 0.0  # rate-following DTS's reference delay D* in samples (0: off)
    dtt: float = 0.0  # DTT's (DTS at SGD's temperature) reference delay D* in samples (0: off)

    @property
    def compensated(self) -> bool:
        """Whether SC or LWP is on (what ``--delay-scale`` scales)."""
        return self.sc > 0 or self.lwp > 0

    @property
    def compensation(self) -> str:
        """``none``, ``sc``, ``lwp``, ``sc+lwp``, ``sc+lwp+dlr16``, ... (for
        :func:`pipetrain.optim.build_stage_optimizers`)."""
        parts = [name for name, value in (("sc", self.sc), ("lwp", self.lwp)) if value > 0]
        if self.dlr > 0:
            parts.append(f"dlr{self.dlr:g}")
        if self.dts > 0:
            parts.append(f"dts{self.dts:g}")
        if self.dtsf > 0:
            parts.append(f"dtsf{self.dtsf:g}")
        if self.dtt > 0:
            parts.append(f"dtt{self.dtt:g}")
        return "+".join(parts) or "none"

    def __str__(self) -> str:
        return self.name


def parse_method(text: str) -> Method:
    """``sgd``, ``sgd-batch``, ``pb``, ``pb+sc``, ``pb+lwp``, ``pb+sc+lwp``, ``pb+sc0.5+lwp0.5``,
    ``pb+sc0.5+lwp+dlr16``, ``pb+sc+lwp+dts4``, ``pb+sc+lwp+dtt4``."""
    name = text.strip().lower()
    if name == "sgd":
        return Method("sgd", pipelined=False)
    if name in ("sgd-batch", "sgd-b", "batch-sgd"):
        return Method("sgd-batch", pipelined=False, batch=True)
    parts = name.split("+")
    if parts[0] != "pb":
        raise ConfigError(
            f"unknown method {text!r}; valid: sgd-batch, sgd, pb, pb+sc, pb+lwp, pb+sc+lwp, "
            f"scaled compensation such as pb+sc0.5+lwp0.5, with +dlr or +dlrN (delay-scaled lr) or +dts or "
            f"+dtsN (delay time scaling)"
        )
    scales = {"sc": 0.0, "lwp": 0.0, "dlr": 0.0, "dts": 0.0, "dtsf": 0.0, "dtt": 0.0}
    for part in parts[1:]:
        match = _PART.match(part)
        if match is None:
            raise ConfigError(
                f"method {text!r}: {part!r} is not sc, lwp, scN or lwpN (N: a multiple of the stage "
                f"delay, e.g. sc0.5), dlr or dlrN, dts or dtsN (N: the reference delay in samples, e.g. dlr16, dts4)"
            )
        kind, value = match.group(1), match.group(2)
        if scales[kind]:
            raise ConfigError(f"method {text!r} names {kind} twice")
        default = {"dlr": DEFAULT_DLR_DELAY, "dts": DEFAULT_DTS_DELAY, "dtsf": DEFAULT_DTS_DELAY,
                   "dtt": DEFAULT_DTS_DELAY}.get(kind, 1.0)
        scale = default if value is None else float(value)
        if scale <= 0:
            what = "reference delay" if kind in ("dlr", "dts", "dtsf", "dtt") else "scale"
            raise ConfigError(f"method {text!r}: the {kind} {what} must be > 0 (leave {kind} out instead)")
        scales[kind] = scale
    scaled = [kind for kind in ("dlr", "dts", "dtsf", "dtt") if scales[kind]]
    if len(scaled) > 1:
        raise ConfigError(
            f"method {text!r} names both {scaled[0]} and {scaled[1]}; each scales every stage's rate by its delay: "
            "name one"
        )
    return Method(
        name, pipelined=True, sc=scales["sc"], lwp=scales["lwp"], dlr=scales["dlr"], dts=scales["dts"],
        dtsf=scales["dtsf"], dtt=scales["dtt"],
    )


def parse_methods(text: str) -> list[Method]:
    """A comma-separated list of methods, duplicates removed, order kept."""
    methods: list[Method] = []
    for part in text.split(","):
        if part.strip():
            method = parse_method(part)
            if method not in methods:
                methods.append(method)
    if not methods:
        raise ConfigError(f"{option('methods')} is empty; give e.g. sgd,pb,pb+sc,pb+lwp,pb+sc+lwp")
    return methods
