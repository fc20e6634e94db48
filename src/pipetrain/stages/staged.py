"""A model cut into stages, the call convention at stage boundaries, and state-dict mapping.

Call convention: a stage receives what the previous stage returned, read as arguments. A tuple or a
list is unpacked into positional arguments (``stage(*outputs)``), a dict into keyword arguments
(``stage(**outputs)``), anything else (a tensor) is the one argument. The first stage receives the
model input by the same rule: a batch ``x`` that is ``(src, tgt_in)`` calls ``stage0(src, tgt_in)``,
``{"input_ids": ..., "attention_mask": ...}`` calls ``stage0(input_ids=..., attention_mask=...)``.
A stage may return a tensor, or tuples, lists and dicts of tensors nested in any way; every
executor hands the next stage exactly that structure (:mod:`pipetrain.structure`), and gradients
come back for its floating-point tensors (integer and boolean ones, token ids and masks, take none).

A stage cut from an ``nn.Sequential`` (a :class:`StageSequential`) packs several arguments back
into one tuple for its first module (keyword arguments into one dict), so a Sequential whose
modules hand tuples or dicts to each other computes the same when cut anywhere. (A 1-tuple reaches
the next stage as its one item: return tensors, or tuples of two or more.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.structure import arguments
from pipetrain.stages.tied import TiedParameter, check_tied_copies

__all__ = ["StageSequential", "StagedModel", "call_stage", "run_stages"]


class StageSequential(nn.Sequential):
    """Consecutive modules of an ``nn.Sequential`` under their original names.

    Keeping the names ("3", "4", ...) makes this stage's state-dict keys equal to the unsplit
    model's keys, and ``forward(*inputs)`` follows the boundary convention of this module.
    """

    def forward(self, *inputs: Any, **named: Any) -> Any:  # type: ignore[override]
        if named:
            if inputs:
                raise TypeError("a StageSequential takes positional or keyword inputs, not both")
            x: Any = named
        else:
            x = inputs[0] if len(inputs) == 1 else inputs
        for module in self:
            x = module(x)
        return x


def call_stage(stage: nn.Module, inputs: Any) -> Any:
    """Run ``stage`` on what the previous stage returned, under the call convention (``stage(*inputs)``
    for a tuple or list, ``stage(**inputs)`` for a dict, else ``stage(inputs)``)."""
    args, kwargs = arguments(inputs)
    return stage(*args, **kwargs)


def run_stages(stages: Sequence[nn.Module], *inputs: Any) -> Any:
    """Run ``stages`` one after the other on ``inputs`` (as the model's forward takes them; a
    structured batch ``x`` as ``run_stages(stages, x)``): equals the unsplit model's forward."""
    x: Any = inputs[0] if len(inputs) == 1 else inputs
    for stage in stages:
        x = call_stage(stage, x)
    return x


@dataclass
class StagedModel:
    """Stage modules plus the mapping of their state-dict keys to the unsplit model's.

    ``key_map[s]`` maps each key of ``stages[s].state_dict()`` to the unsplit model's key;
    ``model_keys`` lists the unsplit state dict's keys in order; ``aliases`` maps each further
    key of a tensor the unsplit model holds under several names (tied weights) to the key it
    shares it with. ``balance`` is the module count per stage when cut from an ``nn.Sequential``.
    Stages share their modules with the model they were cut from (nothing is copied).

    A model cut by tracing (torch.fx) also records ``split_at``, the module that starts each
    stage after the first (``split_model(model, split_at=...)`` with these names cuts it the same
    way again), ``boundaries[b]``, the names of the values stage ``b`` hands to stage ``b + 1``,
    and ``unused``, state of modules that ``forward`` never calls (no stage holds it; it is saved
    unchanged by :meth:`merge_state_dict`).

    ``tied`` lists the parameters that several stages hold (tied weights, see
    :mod:`pipetrain.stages.tied`): each stage executor keeps its own copy, which the synchronous
    schedules keep equal by summing their gradients.
    """

    stages: list[nn.Module]
    key_map: list[dict[str, str]]
    model_keys: list[str]
    balance: list[int] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    split_at: list[str] | None = None
    boundaries: list[list[str]] | None = None
    unused: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: list[TiedParameter] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.stages)

    def __call__(self, *inputs: Any) -> Any:
        return run_stages(self.stages, *inputs)

    def parameter_counts(self) -> list[int]:
        """Parameter elements per stage."""
        return [sum(p.numel() for p in stage.parameters()) for stage in self.stages]

    def summary(self) -> str:
        """One line per stage: parameter count, first module, and the values it receives."""
        lines = []
        counts = self.parameter_counts()
        for s, count in enumerate(counts):
            start = "" if self.split_at is None else (f" from {self.split_at[s - 1]}" if s else " from the input")
            inputs = ""
            if self.boundaries is not None and s:
                inputs = f"  inputs: {', '.join(self.boundaries[s - 1])}"
            elif self.balance is not None:
                inputs = f"  units: {self.balance[s]}"
            lines.append(f"stage {s}: {count:>9} parameters{start}{inputs}")
        return "\n".join(lines)

    def merge_state_dict(self, stage_state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One state dict, loadable with ``strict=True`` by the unsplit model, from one per stage.

        Each input holds a stage's keys (``stages[s].state_dict()`` keys); tensors are not copied.
        The copies of a parameter that several stages hold must be equal (one tensor is saved).
        """
        if len(stage_state_dicts) != len(self.stages):
            raise ConfigError(
                f"merge_state_dict got {len(stage_state_dicts)} state dicts for {len(self.stages)} stages"
            )
        check_tied_copies(self.tied, dict(enumerate(stage_state_dicts)))
        merged: dict[str, torch.Tensor] = {}
        for s, (state, mapping) in enumerate(zip(stage_state_dicts, self.key_map)):
            missing = [k for k in mapping if k not in state]
            unexpected = [k for k in state if k not in mapping]
            if missing or unexpected:
                raise ConfigError(
                    f"state dict of stage {s} does not match the stage: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}"
                )
            for key, value in state.items():
                merged[mapping[key]] = value
        merged.update(self.unused)
        for key, target in self.aliases.items():
            merged[key] = merged[target]
        return {key: merged[key] for key in self.model_keys}

    def split_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The inverse of :meth:`merge_state_dict`: one state dict per stage, stage keys."""
        missing = [k for k in self.model_keys if k not in state_dict]
        if missing:
            raise ConfigError(
                f"state dict lacks {len(missing)} key(s) of the model, e.g. {missing[:3]}: it was "
                f"saved from a different model or options"
            )
        return [{key: state_dict[target] for key, target in mapping.items()} for mapping in self.key_map]
