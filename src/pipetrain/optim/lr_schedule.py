"""Learning-rate schedules that count training samples, not optimizer steps.

A pipeline with batch size 1 updates after every sample while a synchronous schedule updates after
every batch; counting samples lets one schedule mean the same thing for both. A schedule is a pure
function of ``samples_seen`` (no state to checkpoint): it returns a factor that multiplies the
optimizer's base learning rate.

``samples_seen`` is the number of training samples whose gradients were applied *before* the
update (or forward) that asks: the first update asks for ``lr_at(0)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pipetrain.errors import ConfigError
from pipetrain.optim.keyvalue import as_count, as_float, parse_options, split_spec

__all__ = [
    "LRSchedule",
    "ConstantLR",
    "StepLR",
    "CosineLR",
    "EndDecayLR",
    "parse_lr_schedule",
    "LR_SCHEDULES",
]


@dataclass(frozen=True, kw_only=True)
class LRSchedule(ABC):
    """A learning-rate factor as a function of samples seen, with an optional linear warm-up.

    During the first ``warmup`` samples the factor of the main schedule is multiplied by a ramp
    that rises linearly from ``warmup_start`` (at sample 0) to 1 (at sample ``warmup``).
    """

    warmup: int = 0
    warmup_start: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"warmup={self.warmup} must be >= 0 samples")
        if not 0.0 <= self.warmup_start <= 1.0:
            raise ConfigError(f"warmup_start={self.warmup_start} must lie in [0, 1]")

    def factor(self, samples_seen: int) -> float:
        """The multiplier of the base learning rate after ``samples_seen`` samples."""
        if samples_seen < 0:
            raise ConfigError(f"samples_seen={samples_seen} must be >= 0")
        main = self._main(samples_seen)
        if samples_seen < self.warmup:
            ramp = self.warmup_start + (1.0 - self.warmup_start) * samples_seen / self.warmup
            return ramp * main
        return main

    def lr_at(self, samples_seen: int, base_lr: float) -> float:
        """The learning rate in force after ``samples_seen`` samples, for base rate ``base_lr``."""
        return base_lr * self.factor(samples_seen)

    @abstractmethod
    def _main(self, samples_seen: int) -> float:
        """The factor of the schedule without warm-up."""


@dataclass(frozen=True, kw_only=True)
class ConstantLR(LRSchedule):
    """Factor 1 (after the optional warm-up)."""

    def _main(self, samples_seen: int) -> float:
        return 1.0


@dataclass(frozen=True, kw_only=True)
class StepLR(LRSchedule):
    """Multiply by ``gamma`` at each milestone: ``gamma ** #(milestones <= samples_seen)``."""

    milestones: tuple[int, ...] = ()
    gamma: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if list(self.milestones) != sorted(set(self.milestones)) or any(
            m < 0 for m in self.milestones
        ):
            raise ConfigError(
                f"milestones={self.milestones} must be increasing sample counts >= 0, "
                "for example milestones=30000/60000"
            )
        if self.gamma < 0:
            raise ConfigError(f"gamma={self.gamma} must be >= 0")

    def _main(self, samples_seen: int) -> float:
        passed = sum(1 for m in self.milestones if samples_seen >= m)
        return self.gamma**passed


@dataclass(frozen=True, kw_only=True)
class CosineLR(LRSchedule):
    """Half a cosine from 1 (at the end of the warm-up) down to ``final`` at ``total`` samples."""

    total: int = 0
    final: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total <= self.warmup:
            raise ConfigError(
                f"cosine schedule needs total={self.total} > warmup={self.warmup} samples; "
                "give total= the number of training samples"
            )

    def _main(self, samples_seen: int) -> float:
        if samples_seen <= self.warmup:
            return 1.0
        progress = min(samples_seen - self.warmup, self.total - self.warmup)
        progress /= self.total - self.warmup
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True)
class EndDecayLR(LRSchedule):
    """Constant, then decay over the last ``fraction`` of ``total`` samples.

    ``shape="linear"`` ramps linearly down to ``final`` (default 0) at ``total``; ``shape="step"``
    drops at once to ``final`` (default 0.1) when the last fraction begins.
    """

    total: int = 0
    fraction: float = 0.1
    shape: str = "linear"
    final: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total <= 0:
            raise ConfigError(f"end-decay schedule needs total={self.total} > 0 training samples")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction={self.fraction} must lie in (0, 1]")
        if self.shape not in ("linear", "step"):
            raise ConfigError(f"shape={self.shape!r} must be 'linear' or 'step'")

    @property
    def final_factor(self) -> float:
        if self.final is not None:
            return self.final
        return 0.0 if self.shape == "linear" else 0.1

    def _main(self, samples_seen: int) -> float:
        start = self.total * (1.0 - self.fraction)
        if samples_seen < start:
            return 1.0
        if self.shape == "step" or samples_seen >= self.total:
            return self.final_factor
        return 1.0 - (1.0 - self.final_factor) * (samples_seen - start) / (self.total - start)


def _milestones(key: str, value: str) -> tuple[int, ...]:
    return tuple(as_count(key, part) for part in value.split("/"))


def _shape(key: str, value: str) -> str:
    return value.lower()


_WARMUP = {"warmup": as_count, "warmup_start": as_float}

# spec name -> (class, option parsers)
LR_SCHEDULES: dict[str, tuple[type[LRSchedule], dict]] = {
    "constant": (ConstantLR, dict(_WARMUP)),
    "step": (StepLR, {"milestones": _milestones, "gamma": as_float, **_WARMUP}),
    "cosine": (CosineLR, {"total": as_count, "final": as_float, **_WARMUP}),
    "end": (
        EndDecayLR,
        {"total": as_count, "fraction": as_float, "shape": _shape, "final": as_float, **_WARMUP},
    ),
}

_REQUIRED = {"cosine": ("total",), "end": ("total",), "step": ("milestones",)}


def parse_lr_schedule(text: str) -> LRSchedule:
    """Parse a schedule spec, sample counts throughout. Examples::

        constant                      constant:warmup=1000
        step:milestones=30000/60000,gamma=0.1
        cosine:total=100000,final=0.0,warmup=1000
        end:total=100000,fraction=0.2,shape=linear      (or shape=step,final=0.1)
    """
    name, raw = split_spec(text, "lr schedule", LR_SCHEDULES)
    cls, parsers = LR_SCHEDULES[name]
    options = parse_options(name, raw, parsers, "lr schedule")
    missing = [key for key in _REQUIRED.get(name, ()) if key not in options]
    if missing:
        raise ConfigError(
            f"lr schedule {name!r} needs {', '.join(k + '=...' for k in missing)} in {text!r}"
        )
    return cls(**options)
