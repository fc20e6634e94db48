"""Per-stage optimizers: out-of-place SGD/Adam, delay compensation, sample-based lr schedules."""

from pipetrain.optim.adam import Adam, AdamW
from pipetrain.optim.base import StageOptimizer
from pipetrain.optim.compensation import parse_compensation, spike_coefficients
from pipetrain.optim.lr_schedule import (
    ConstantLR,
    CosineLR,
    EndDecayLR,
    LRSchedule,
    StepLR,
    parse_lr_schedule,
)
from pipetrain.optim.sgd import SGD
from pipetrain.optim.spec import (
    OptimizerSpec,
    build_stage_optimizer,
    build_stage_optimizers,
    parse_optimizer_spec,
)
from pipetrain.optim.translate import TranslatedHyperparameters, translate_hyperparameters

__all__ = [
    "StageOptimizer",
    "SGD",
    "Adam",
    "AdamW",
    "spike_coefficients",
    "parse_compensation",
    "LRSchedule",
    "ConstantLR",
    "StepLR",
    "CosineLR",
    "EndDecayLR",
    "parse_lr_schedule",
    "OptimizerSpec",
    "parse_optimizer_spec",
    "build_stage_optimizer",
    "build_stage_optimizers",
    "TranslatedHyperparameters",
    "translate_hyperparameters",
]
