"""Per-stage optimizers: out-of-place SGD/Adam, delay compensation, sample-based lr schedules."""

import importlib

# name -> submodule. The optimizers import PyTorch; their specs, lr schedules, compensation and
# translation do not: each name is loaded on first use, so that `pipetrain train` checks an
# --optimizer or --lr-schedule spec before PyTorch is imported.
_WHERE = {
    "Adam": "adam", "AdamW": "adam", "StageOptimizer": "base",
    "parse_compensation": "compensation", "spike_coefficients": "compensation",
    "delay_lr_factor": "compensation", "parse_dlr_delay": "compensation",
    "time_scaled_settings": "compensation", "parse_dts_delay": "compensation",
    "rate_following_settings": "compensation", "parse_dtsf_delay": "compensation", "RateFollowingSGD": "sgd",
    "temperature_settings": "compensation", "parse_dtt_delay": "compensation",
    "ConstantLR": "lr_schedule", "CosineLR": "lr_schedule", "EndDecayLR": "lr_schedule",
    "LRSchedule": "lr_schedule", "StepLR": "lr_schedule", "parse_lr_schedule": "lr_schedule",
    "SGD": "sgd",
    "OptimizerSpec": "spec", "build_stage_optimizer": "spec", "build_stage_optimizers": "spec",
    "parse_optimizer_spec": "spec",
    "TranslatedHyperparameters": "translate", "translate_hyperparameters": "translate",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"pipetrain.optim.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'pipetrain.optim' has no attribute {name!r}")


__all__ = [
    "StageOptimizer",
    "SGD",
    "Adam",
    "AdamW",
    "spike_coefficients",
    "parse_compensation",
    "delay_lr_factor",
    "parse_dlr_delay",
    "time_scaled_settings",
    "parse_dts_delay",
    "rate_following_settings",
    "parse_dtsf_delay",
    "RateFollowingSGD",
    "temperature_settings",
    "parse_dtt_delay",
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
