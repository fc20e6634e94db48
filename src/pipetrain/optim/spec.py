"""Optimizer spec strings (``sgd:lr=0.1,momentum=0.9``) and building one optimizer per stage."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from pipetrain.errors import ConfigError, option
from pipetrain.optim.compensation import (delay_lr_factor, parse_compensation, parse_dlr_delay, parse_dts_delay,
                                          parse_dtsf_delay, parse_dtt_delay, refuse_other_than_sgd,
                                          temperature_settings, time_scaled_settings)
from pipetrain.optim.keyvalue import as_bool, as_float, as_float_pair, parse_options, split_spec
from pipetrain.optim.lr_schedule import LRSchedule, parse_lr_schedule

if TYPE_CHECKING:
    from pipetrain.optim.base import StageOptimizer

__all__ = [
    "OPTIMIZERS",  # noqa: F822 - made on first use (module __getattr__)
    "optimizer_class",
    "OptimizerSpec",
    "parse_optimizer_spec",
    "build_stage_optimizer",
    "build_stage_optimizers",
]

_ADAM_OPTIONS: dict[str, Callable[[str, str], Any]] = {
    "lr": as_float,
    "betas": as_float_pair,
    "eps": as_float,
    "weight_decay": as_float,
    "amsgrad": as_bool,
}

#: spec name -> option parsers. Parsing a spec needs no PyTorch; building the optimizer does.
_OPTIONS: dict[str, dict[str, Callable[[str, str], Any]]] = {
    "sgd": {
        "lr": as_float,
        "momentum": as_float,
        "dampening": as_float,
        "weight_decay": as_float,
        "nesterov": as_bool,
    },
    "adam": _ADAM_OPTIONS,
    "adamw": _ADAM_OPTIONS,
}
_CLASSES = {"sgd": ("pipetrain.optim.sgd", "SGD"), "adam": ("pipetrain.optim.adam", "Adam"),
            "adamw": ("pipetrain.optim.adam", "AdamW")}
#: SGD with DTS-F's rate-following momentum (the ``dtsf`` compensation)
_RATE_FOLLOWING = ("pipetrain.optim.sgd", "RateFollowingSGD")


def _class_at(where: tuple[str, str]) -> "type[StageOptimizer]":
    """The class ``(module, name)``, its module imported on first use: the optimizers import
    PyTorch, and parsing a spec (the checks of ``pipetrain train``) must not."""
    module, attribute = where
    return getattr(importlib.import_module(module), attribute)


def optimizer_class(name: str) -> "type[StageOptimizer]":
    """The :class:`StageOptimizer` class of spec name ``name`` (imported on first use)."""
    return _class_at(_CLASSES[name])


def __getattr__(name: str):
    # OPTIMIZERS: spec name -> (class, option parsers); defaults are those of the classes (torch's)
    if name == "OPTIMIZERS":
        return {key: (optimizer_class(key), options) for key, options in _OPTIONS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class OptimizerSpec:
    """A parsed optimizer spec: the optimizer's name and its typed options (unset = default)."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in _OPTIONS:
            raise ConfigError(
                f"unknown optimizer {self.name!r}; valid names: {', '.join(sorted(_OPTIONS))}"
            )
        valid = _OPTIONS[self.name]
        unknown = sorted(set(self.options) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r} for optimizer {self.name!r}; valid options: "
                f"{', '.join(sorted(valid))}"
            )

    def __str__(self) -> str:
        """The canonical spec string; :func:`parse_optimizer_spec` reads it back."""
        parts = [f"{key}={_format(value)}" for key, value in self.options.items()]
        return self.name + (":" + ",".join(parts) if parts else "")


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "/".join(_format(item) for item in value)
    return repr(value)


def parse_optimizer_spec(text: str | OptimizerSpec) -> OptimizerSpec:
    """Parse ``sgd:lr=0.1,momentum=0.9,nesterov=true,weight_decay=1e-4,dampening=0``,
    ``adam:lr=1e-3,betas=0.9/0.999,eps=1e-8,weight_decay=0,amsgrad=false`` or ``adamw:...``."""
    if isinstance(text, OptimizerSpec):
        return text
    name, raw = split_spec(text, "optimizer", _OPTIONS)
    return OptimizerSpec(name, parse_options(name, raw, _OPTIONS[name], "optimizer"))


def build_stage_optimizer(
    spec: str | OptimizerSpec,
    *,
    stage_delay: float = 0.0,
    compensation: str | Iterable[str] | None = None,
    sc_delay: float | None = None,
    lwp_horizon: float | None = None,
    lr_schedule: str | LRSchedule | None = None,
    dlr_delay: float | None = None,
    dts_delay: float | None = None,
    dtsf_delay: float | None = None,
    dtt_delay: float | None = None,
) -> StageOptimizer:
    """The optimizer of one pipeline stage whose gradients arrive ``stage_delay`` updates late.

    ``compensation`` is ``"none"``, ``"sc"``, ``"lwp"``, ``"dlr"`` (or ``"dlrN"``), joined by
    ``+`` (``"sc+lwp+dlr16"``), or a set of those names. Spike Compensation uses delay
    ``sc_delay`` and LWP horizon ``lwp_horizon``; each defaults to ``stage_delay`` and may be given
    only when its compensation is on. The delay-scaled learning rate multiplies the spec's ``lr``
    by ``delay_lr_factor(stage_delay, D*)`` with ``D* = dlr_delay`` (default: the N of ``dlrN``,
    else ``DEFAULT_DLR_DELAY``). Delay time scaling (``"dts"``/``"dtsN"``, momentum SGD only)
    multiplies ``lr`` by ``1/k**2`` and sets the momentum to ``1 - (1 - m)/k``, ``k = stage_delay/D*``
    where above 1 (:func:`~pipetrain.optim.compensation.time_scaled_settings`), ``D* = dts_delay``
    (default: the N of ``dtsN``, else ``DEFAULT_DTS_DELAY``). Its rate-following variant
    (``"dtsf"``/``"dtsfN"``, ``D* = dtsf_delay``) gives a stage beyond D* a
    :class:`~pipetrain.optim.sgd.RateFollowingSGD`, whose ``k`` shrinks as the lr schedule decays;
    ``"dtt"``/``"dttN"`` (``D* = dtt_delay``) takes DTS's rate with the memory ``k**2`` times longer
    (:func:`~pipetrain.optim.compensation.temperature_settings`).
    """
    parsed = parse_optimizer_spec(spec)
    methods = parse_compensation(compensation)
    for name, value in (("sc", sc_delay), ("lwp", lwp_horizon), ("dlr", dlr_delay), ("dts", dts_delay),
                        ("dtsf", dtsf_delay), ("dtt", dtt_delay)):
        if value is not None and name not in methods:
            label = {"sc": "sc_delay", "lwp": "lwp_horizon", "dlr": "dlr_delay", "dts": "dts_delay",
                     "dtsf": "dtsf_delay", "dtt": "dtt_delay"}[name]
            raise ConfigError(
                f"{label}={value} is set but compensation {name!r} is off; add {name} to the "
                f"compensation (e.g. sc+lwp+{name}) or drop the setting"
            )
    if not stage_delay >= 0:
        raise ConfigError(f"stage_delay={stage_delay} must be >= 0")
    schedule = parse_lr_schedule(lr_schedule) if isinstance(lr_schedule, str) else lr_schedule
    kwargs: dict[str, Any] = dict(parsed.options)
    kwargs["lr_schedule"] = schedule
    if "lwp" in methods:
        kwargs["lwp_horizon"] = stage_delay if lwp_horizon is None else lwp_horizon
    if "sc" in methods:
        if parsed.name != "sgd":
            raise ConfigError(
                f"spike compensation is defined for momentum SGD only, not {parsed.name!r}; use "
                f"{option('optimizer', 'sgd:momentum=...')} with sc, or lwp alone with Adam (it predicts along "
                "the Adam step)"
            )
        kwargs["sc_delay"] = stage_delay if sc_delay is None else sc_delay
    dts_factor = 1.0
    for name in ("dts", "dtt"):
        if name not in methods:
            continue
        refuse_other_than_sgd(name, parsed.name)
        if name == "dts":
            reference = parse_dts_delay(compensation) if dts_delay is None else float(dts_delay)
            settings = time_scaled_settings
        else:
            reference = parse_dtt_delay(compensation) if dtt_delay is None else float(dtt_delay)
            settings = temperature_settings
        momentum = float(kwargs.get("momentum", 0.0))
        dts_factor, momentum = settings(momentum, stage_delay, reference)  # type: ignore[arg-type]
        if dts_factor != 1.0:  # a stage at or below D* keeps its rate and momentum bit for bit
            kwargs["momentum"] = momentum  # before the optimizer is built: SC's coefficients use it
    if "dtsf" in methods:
        refuse_other_than_sgd("dtsf", parsed.name)
        reference = parse_dtsf_delay(compensation) if dtsf_delay is None else float(dtsf_delay)
        momentum = float(kwargs.get("momentum", 0.0))
        fast, _ = time_scaled_settings(momentum, stage_delay, reference)  # type: ignore[arg-type]
        if fast != 1.0:  # a stage at or below D* is plain SGD, bit for bit
            return _class_at(_RATE_FOLLOWING)(**kwargs, stage_delay=stage_delay,  # type: ignore[call-arg]
                                              reference_delay=reference)
    optimizer = optimizer_class(parsed.name)(**kwargs)
    if dts_factor != 1.0:
        optimizer.lr = optimizer.lr * dts_factor
    if "dlr" in methods:
        reference = parse_dlr_delay(compensation) if dlr_delay is None else float(dlr_delay)
        factor = delay_lr_factor(stage_delay, reference)  # type: ignore[arg-type]
        if factor != 1.0:  # a stage at or below D* keeps its rate bit for bit
            optimizer.lr = optimizer.lr * factor
    return optimizer


def build_stage_optimizers(
    spec: str | OptimizerSpec,
    stage_delays: Sequence[float],
    *,
    compensation: str | Iterable[str] | None = None,
    sc_delays: Sequence[float] | None = None,
    lwp_horizons: Sequence[float] | None = None,
    lr_schedule: str | LRSchedule | None = None,
    dlr_delay: float | None = None,
    dts_delay: float | None = None,
    dtsf_delay: float | None = None,
    dtt_delay: float | None = None,
) -> list[StageOptimizer]:
    """One optimizer per stage; ``stage_delays[s]`` is D_s (e.g. ``2*(S-1-s)`` for PB)."""
    count = len(stage_delays)
    for label, values in (("sc_delays", sc_delays), ("lwp_horizons", lwp_horizons)):
        if values is not None and len(values) != count:
            raise ConfigError(f"{label} has {len(values)} entries but there are {count} stages")
    schedule = parse_lr_schedule(lr_schedule) if isinstance(lr_schedule, str) else lr_schedule
    return [
        build_stage_optimizer(
            spec,
            stage_delay=stage_delays[s],
            compensation=compensation,
            sc_delay=None if sc_delays is None else sc_delays[s],
            lwp_horizon=None if lwp_horizons is None else lwp_horizons[s],
            lr_schedule=schedule,
            dlr_delay=dlr_delay,
            dts_delay=dts_delay,
            dtsf_delay=dtsf_delay,
            dtt_delay=dtt_delay,
        )
        for s in range(count)
    ]
