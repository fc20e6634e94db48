"""The float16 loss scale: one dynamic scale for the whole pipeline, decided by stage 0."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipetrain.errors import ConfigError, NonFiniteError

__all__ = ["LossScale", "DEFAULT_INIT", "DEFAULT_GROWTH", "MIN_SCALE", "check_power_of_two"]

#: the dynamic scale's first value (``--loss-scale-init``), as torch's GradScaler
DEFAULT_INIT = 2.0 ** 16
#: clean updates after which the dynamic scale doubles (``--loss-scale-growth``), as torch's GradScaler
DEFAULT_GROWTH = 2000
#: a dynamic scale halved below this stops the run: float16's smallest subnormal; the gradient
#: overflows float16 whatever the scale (use bf16)
MIN_SCALE = 2.0 ** -24


def check_power_of_two(option: str, value: float) -> None:
    """Scales are powers of two, so that removing one from a float32 gradient is exact."""
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            and math.frexp(value)[0] == 0.5):
        raise ConfigError(f"{option} must be a power of two such as 65536 or 1024 (removing it from the gradient "
                          f"is then exact), not {value!r}")


@dataclass
class LossScale:
    """The scale stage 0 stamps on each update's microbatches, and how it moves.

    Only stage 0's copy moves (:meth:`update`, once per update, with that update's skip
    decision, which on stage 0 includes every overflow flag that travelled back); the other stages
    use the scale each microbatch's forward message carries. ``dynamic=False``: a fixed scale
    (overflowing updates are still skipped)."""

    init: float = DEFAULT_INIT
    growth_interval: int = DEFAULT_GROWTH
    dynamic: bool = True
    scale: float = field(init=False)
    clean: int = 0  # clean updates since the last change

    def __post_init__(self) -> None:
        self.scale = float(self.init)

    def update(self, overflow: bool, step: int) -> None:
        """After update ``step`` (counted from 1): halve on overflow, double after
        ``growth_interval`` clean updates in a row."""
        if not self.dynamic:
            return
        if overflow:
            self.clean = 0
            self.scale /= 2
            if self.scale < MIN_SCALE:
                raise NonFiniteError(
                    f"stage 0: update {step} overflowed float16 with a loss scale of {self.scale * 2:g}, the "
                    "smallest there is: the gradient is not finite whatever the scale; training stopped there. Use "
                    "--precision bf16 (float32's range) or lower lr in --optimizer", stage=0, step=step)
        else:
            self.clean += 1
            if self.clean >= self.growth_interval:
                self.clean = 0
                self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean = float(state["scale"]), int(state["clean"])
