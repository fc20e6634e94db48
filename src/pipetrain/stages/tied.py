"""Parameters that several stages share (tied weights), found by tensor identity.

An LM head tied to the input embedding is one ``nn.Parameter`` used by the first stage and by the
last. Every stage executor keeps its own copy of its parameters, so a parameter shared by two
stages becomes two copies; they stay one parameter only if every copy takes the same update. On
synchronous schedules the holders sum the gradient of each shared parameter before their update
(:class:`pipetrain.execution.TiedGradients`), so training equals plain tied training; schedules
that keep several weight versions per stage are refused (:func:`refuse_tied`). The split records
what is shared in :attr:`StagedModel.tied <pipetrain.stages.StagedModel.tied>`, whichever way the
model was cut (a list of stage modules, an ``nn.Sequential`` or a traced model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError

__all__ = ["TiedParameter", "check_tied_copies", "find_tied", "refuse_tied"]


@dataclass(frozen=True)
class TiedParameter:
    """One parameter held by several stages.

    ``name`` is the unsplit model's key for it and ``keys`` all its keys there (the others are
    aliases); ``holders`` lists ``(stage, name)`` in stage order, ``name`` being the parameter's
    name in that stage's ``named_parameters()`` (and state dict). ``trainable``: whether it
    requires grad (a frozen shared parameter never changes, so its copies never differ). ``uses``
    names each holder's use by the model's key for it (``lm_head.weight`` where the stage calls it
    ``head.lm_head.weight``), for messages.
    """

    name: str
    holders: tuple[tuple[int, str], ...]
    trainable: bool = True
    keys: tuple[str, ...] = ()
    uses: tuple[str, ...] = field(default=(), compare=False)

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(stage for stage, _ in self.holders)

    def describe(self) -> str:
        """``'wte.weight' (stage 0 as wte.weight, stage 3 as head.weight)``: the model's names of
        the uses the stages hold."""
        names = self.uses or tuple(name for _, name in self.holders)
        uses = ", ".join(f"stage {stage} as {name}" for (stage, _), name in zip(self.holders, names))
        return f"{self.name!r} ({uses})"

    def untie(self) -> str:
        """Python that unties the uses of the later stages from the first stage's, e.g.
        ``model.head.weight = nn.Parameter(model.wte.weight.detach().clone())``; "" if unknown."""
        names = self.uses or (self.keys[:1] + self.keys[-1:] if len(self.keys) > 1 else ())
        first = names[0] if names else ""
        later = [n for n in dict.fromkeys(names[1:]) if n != first]
        return "; ".join(f"model.{n} = nn.Parameter(model.{first}.detach().clone())" for n in later)


def find_tied(stages: Sequence[nn.Module], model: nn.Module | None = None) -> list[TiedParameter]:
    """The parameters that two or more of ``stages`` hold, in order of first use.

    Names come from ``model``'s state dict (the unsplit model's keys); without ``model`` the
    unsplit model is taken to be ``nn.Sequential(*stages)``, as :func:`~pipetrain.stages.from_stages`
    does.
    """
    if model is None:
        model = nn.Sequential(*stages)
    keys: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(value), []).append(key)
    module_names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(module), []).append(name)
    uses: dict[int, list[tuple[int, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            uses.setdefault(id(p), []).append((s, name))
            params[id(p)] = p
    tied = []
    for pid, holders in uses.items():
        if len({s for s, _ in holders}) > 1:
            names = tuple(keys.get(pid, [holders[0][1]]))
            uses = tuple(_model_name(stages[s], name, module_names, names) for s, name in holders)
            tied.append(TiedParameter(names[0], tuple(holders), params[pid].requires_grad, names, uses))
    return tied


def _model_name(stage: nn.Module, name: str, module_names: dict[int, list[str]], keys: Sequence[str]) -> str:
    """The model's key for parameter ``name`` of ``stage``: the owning module's name in the model
    (of several, the one ending most like ``name``), then the attribute."""
    owner, _, attr = name.rpartition(".")
    candidates = [f"{n}.{attr}" if n else attr for n in module_names.get(id(stage.get_submodule(owner)), [])]
    candidates = [c for c in candidates if c in keys] or candidates
    if not candidates:
        return name
    parts = name.split(".")

    def common_tail(candidate: str) -> int:
        other = candidate.split(".")
        n = 0
        while n < min(len(parts), len(other)) and parts[-1 - n] == other[-1 - n]:
            n += 1
        return n

    return max(candidates, key=common_tail)


def refuse_tied(tied: Sequence[TiedParameter], why: str) -> None:
    """Raise a ConfigError naming the first trainable shared parameter and its stages, if any.

    ``why`` says what cannot keep copies of one parameter equal, e.g. "the pipedream schedule
    keeps several weight versions per stage".
    """
    shared = [t for t in tied if t.trainable]
    if not shared:
        return
    first = shared[0]
    more = f" (and {len(shared) - 1} more)" if len(shared) > 1 else ""
    untie = first.untie()
    untie = f", e.g. {untie}" if untie else ""
    numbers = [str(s) for s in dict.fromkeys(first.stages)]
    stages = " and ".join(numbers) if len(numbers) < 3 else f"{', '.join(numbers[:-1])} and {numbers[-1]}"
    raise ConfigError(
        f"parameter {first.describe()} is shared by stages {stages} (tied weights){more}, but {why}, so its "
        f"copies would drift apart. Use a synchronous schedule (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, "
        f"v-half, v-min, zb-auto), on which "
        f"the stages sum its gradient and stay one parameter; or cut the model so that its uses lie in one "
        f"stage; or untie it before splitting{untie}"
    )


def check_tied_copies(tied: Sequence[TiedParameter], states: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
    """Refuse state dicts (by stage) in which the copies of a shared parameter differ.

    Saving then would keep one copy and silently drop the other; after training on a schedule that
    sums tied gradients they are bitwise equal.
    """
    for t in tied:
        present = [(s, states[s][name]) for s, name in t.holders if s in states and name in states[s]]
        for (a, first), (b, other) in zip(present, present[1:]):
            if not torch.equal(first, other):
                raise PipetrainError(
                    f"the copies of shared parameter {t.describe()} differ between stage {a} and stage {b}: they "
                    f"were not trained as one parameter (only synchronous schedules sum their gradients), so no "
                    f"single tensor can be saved for {t.name!r}"
                )
