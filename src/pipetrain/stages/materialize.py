"""Stages of a model built on PyTorch's meta device, given real tensors where they run, and their
first values.

A model built under ``torch.device("meta")`` has the shapes of its parameters and no values: it
costs no memory, so every rank can build the whole model, cut it (tracing needs no values) and then
*materialise* only the stages it runs (:func:`materialize`). Each tensor is allocated on the CPU,
given its first values by the run's initialiser, and moved to the stage's device by the executor,
so no rank ever holds more than its stages. The initialisers (:class:`pipetrain.initialiser.Init`):

* ``"reset"``: each module's own ``reset_parameters()`` (``nn.MultiheadAttention``'s
  ``_reset_parameters()``), children before parents as a constructor runs them, each under a
  generator seeded from the run's seed and the module's qualified name. A module's values depend
  on nothing else, so every cut, stage count and executor starts from the same weights.
  (Model-wide initialisations in a constructor, such as ``nn.Transformer``'s Xavier pass or the
  scaled projections of a GPT, are not repeated: give a function or a directory for those.)
* a function ``init(module, name)``: called for the same modules in the same order and under the
  same seeds, to set the tensors of ``module`` (HuggingFace models: ``model._init_weights``).
* a weights directory (:mod:`pipetrain.weights`): each tensor read by name, only this rank's.

Which modules are called: a module *initialises* the tensors whose first name in the model (its
state-dict name) lies inside it. It is called when it initialises a tensor of the stage and only
tensors of the stage. One that also initialises tensors of other stages (the model itself, a stack
cut in the middle) is never called for a stage: with ``"reset"`` a ``reset_parameters()`` there is
refused, since its values would depend on the cut. A tensor several modules hold (tied weights)
is initialised last by the module of its first name, so every holder starts from the same values.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import weakref
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError, option
from pipetrain.initialiser import Init
from pipetrain.weights import WeightsDir, check_against, tensor_names

__all__ = ["assign", "load_weights", "has_meta", "materialize", "first_names", "opened", "seed_for"]

#: init="reset" in a message: `--init meta` on the command line (the field's first flag is --init-from)
_RESET = option("init", "reset", flag="--init", cli="meta")

#: torch.nn modules whose constructor initialises them through a private method
_PRIVATE_RESETS = {nn.MultiheadAttention: "_reset_parameters"}


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no values)."""
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def first_names(model: nn.Module) -> dict[int, str]:
    """Each tensor's (parameter's or buffer's) first qualified name in ``model``, by identity: its
    state-dict name, and a name for non-persistent buffers too."""
    first: dict[int, str] = {}
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for attr, value in table.items():
                if value is not None and id(value) not in first:
                    first[id(value)] = f"{prefix}.{attr}" if prefix else attr
    return first


def seed_for(seed: int, name: str) -> int:
    """The seed of module ``name``'s initialisation in a run seeded with ``seed``."""
    digest = hashlib.sha256(f"pipetrain-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def _seeded(seed: int, name: str) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(seed, name))
        yield


def opened(init: Init | None) -> Init | None:
    """``init`` with its weights directory opened (its index read), once for a run: a wrong or
    incomplete directory fails here, before any work, and every stage then reads from it."""
    if init is None or init.kind != "weights" or init.weights is not None:
        return init
    return replace(init, weights=WeightsDir(init.path))


# -- slots: every place that holds a tensor ------------------------------------------------------


def _slots(roots: Sequence[nn.Module]) -> dict[int, list[tuple[dict, str]]]:
    """For each tensor (by identity) held by ``roots``' modules, the ``(table, name)`` entries of
    the modules' ``_parameters`` and ``_buffers`` that hold it (a stage traced by torch.fx has
    containers of its own for the parameters it reads directly)."""
    slots: dict[int, list[tuple[dict, str]]] = {}
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in (module._parameters, module._buffers):
                for attr, value in table.items():
                    if value is not None:
                        slots.setdefault(id(value), []).append((table, attr))
    return slots


def _replace(slots: Mapping[int, list[tuple[dict, str]]], old: torch.Tensor, new: torch.Tensor,
             undo: list | None = None) -> None:
    for table, attr in slots.get(id(old), ()):
        if undo is not None:
            undo.append((table, attr, table[attr]))
        table[attr] = new


def _real(old: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU tensor for meta tensor ``old`` (a Parameter stays one), empty or holding ``values``."""
    data = torch.empty(old.shape, dtype=old.dtype) if values is None else values.to(old.dtype).reshape(old.shape)
    return nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else data


def assign(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Put ``values`` (state-dict names) into ``model``: meta tensors are replaced by real ones in
    every place that holds them (tied tensors stay tied), real ones get the values copied in."""
    state = model.state_dict(keep_vars=True)
    slots = _slots([model])
    for key, value in values.items():
        old = state[key]
        if old.is_meta:
            _replace(slots, old, _real(old, value))
        else:
            with torch.no_grad():
                old.copy_(value)


def load_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a weights directory (``--save DIR``'s, or a HuggingFace ``save_pretrained`` one) into
    the unsplit ``model``, every tensor checked by name and shape; returns ``model``.

    A model built under ``torch.device("meta")`` gets real tensors (tied ones stay tied); any other
    keeps its tensors, on their device and dtype, with the stored values copied in.
    """
    weights = WeightsDir(path)
    check_against(weights, model)
    values = {}
    for names in tensor_names(model).values():
        values[names[0]] = weights.get(weights.find(names))  # type: ignore[arg-type]
    assign(model, values)
    return model


# -- materialising -------------------------------------------------------------------------------

#: every tensor materialised in this process (a tied tensor made for one stage is another's too)
_MADE: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()


@dataclass
class Materialized:
    """What :func:`materialize` did: the tensors it made, and how to put the meta ones back."""

    made: list[torch.Tensor] = field(default_factory=list)
    undo: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)

    def release(self) -> None:
        """Put the meta tensors back (the real ones are freed once nothing else holds them)."""
        for table, attr, old in reversed(self.undo):
            table[attr] = old
        self.undo.clear()
        self.made.clear()


def materialize(model: nn.Module, part: nn.Module, init: Init | None, *, seed: int,
                keys: Sequence[str] = ()) -> Materialized:
    """Give every meta tensor of ``part`` (a stage or a unit: modules shared with ``model``), and of
    ``model``'s state-dict entries ``keys``, a real CPU tensor with its first values from ``init``
    (see the module docstring). Every place in ``model`` and ``part`` that held a meta tensor holds
    the real one afterwards. Tensors with values are left as they are, except that a weights
    directory's values are copied into them too (an eagerly built model started from saved weights)."""
    state = model.state_dict(keep_vars=True)
    tensors = {id(t): t for t in chain(part.parameters(), part.buffers(), (state[k] for k in keys))}
    old = {tid: t for tid, t in tensors.items() if t.is_meta}
    done = Materialized()
    if init is None:
        if old:
            shown = [k for k, v in state.items() if id(v) in old][:3]
            raise ConfigError(
                f"the model is built on the meta device (no values, e.g. {shown}) and nothing says how to "
                f"initialise it: give {_RESET} (each module's reset_parameters()), "
                f"{option('init')} set to a weights directory (written by {option('save')} or save_pretrained), or "
                f"in Python init=function(module, name)"
            )
        return done
    stored = _stored_values(opened(init).weights, model, tensors) if init.kind == "weights" else {}
    slots = _slots([model, part])
    made: dict[int, torch.Tensor] = {}  # id of the meta tensor -> its real one
    for tid, tensor in old.items():
        new = _real(tensor)
        _replace(slots, tensor, new, done.undo)
        made[tid] = new
        done.made.append(new)
        _MADE.add(new)
    own = {id(made.get(tid, t)) for tid, t in tensors.items()}
    unset = {id(made[tid]) for tid in old if tid not in stored}  # all but the stored values
    if unset:
        # the stage's tensors made in this process (a tied one made for an earlier stage of this
        # process included: its module initialises it again, to the same values); from a weights
        # directory only the tensors it does not store (non-persistent buffers)
        targets = unset if init.kind == "weights" else own & {id(t) for t in _MADE}
        _module_inits(model, init if init.kind == "function" else Init("reset"), seed, own, targets, unset)
    with torch.no_grad():
        for tid, value in stored.items():
            target = made.get(tid, tensors[tid])
            target.copy_(value.reshape(target.shape))
    return done


def _stored_values(weights: Any, model: nn.Module, old: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The values of the meta tensors ``old`` read from ``weights`` (by any of their names),
    checked against their shapes; non-persistent buffers (no name) are left out."""
    names = tensor_names(model)
    values: dict[int, torch.Tensor] = {}
    for tid, tensor in old.items():
        keys = names.get(tid)
        if not keys:
            continue
        key = weights.find(keys)
        if key is None:
            raise ConfigError(f"the weights in {str(weights.path)!r} lack {keys[0]!r}: they were saved from another "
                              f"model (load_weights checks a whole directory against a model)")
        value = weights.get(key)
        if tuple(value.shape) != tuple(tensor.shape):
            raise ConfigError(f"the weights in {str(weights.path)!r} store {key!r} with shape {tuple(value.shape)}, "
                              f"but the model's is {tuple(tensor.shape)}: they were saved from another model")
        values[tid] = value
    return values


def _reset_of(module: nn.Module) -> Callable[[], Any] | None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    private = _PRIVATE_RESETS.get(type(module))
    return getattr(module, private) if private else None


def _initialised_by(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], dict[str, set[int]], dict[int, str]]:
    """The model's modules in constructor order's reverse (children before parents), the tensors
    each one initialises (those whose first name lies inside it) and each tensor's first name."""
    modules = list(model.named_modules())
    first = first_names(model)
    inside: dict[str, set[int]] = {name: set() for name, _ in modules}
    for tensor, name in first.items():
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            inside[".".join(parts[:depth])].add(tensor)
    return list(reversed(modules)), inside, first


def _module_inits(model: nn.Module, init: Init, seed: int, own: set[int], targets: set[int],
                  unset: set[int]) -> None:
    """Call ``init`` for every module that initialises one of ``targets`` and only tensors of this
    stage (``own``; see the module docstring), children first, each under its own seed; with
    ``"reset"``, refuse a tensor in ``unset`` that no reset initialised."""
    order, inside, first = _initialised_by(model)
    covered: set[int] = set()
    for name, module in order:
        tensors = inside[name]
        if not tensors & targets:
            continue
        spans = not tensors <= own
        if init.kind == "function":
            if not spans:
                with _seeded(seed, name):
                    init.function(module, name)  # type: ignore[misc]
                covered |= tensors
            continue
        reset = _reset_of(module)
        if reset is None:
            continue
        if spans:
            raise ConfigError(
                f"init='reset': {name or 'the model'} ({type(module).__name__}) has a reset_parameters() that "
                f"initialises tensors of several stages, so its values would depend on the cut; initialise each "
                f"module's own tensors (init=function(module, name)) or cut the model elsewhere"
            )
        with _seeded(seed, name):
            reset()
        covered |= tensors
    if init.kind == "reset":
        left = sorted(first[t] for t in unset - covered)
        if left:
            owner = left[0].rpartition(".")[0]
            kind = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
            raise ConfigError(
                f"{_RESET} cannot give {left[0]!r} values: its module ({owner or 'the model'}, {kind}) and the "
                f"modules around it have no reset_parameters()" + (f" ({len(left) - 1} more such tensors)" if len(left) > 1 else "")
                + f"; give it one, or set {option('init')} to a weights directory (written by {option('save')}), "
                "or in Python pass init=function(module, name)"
            )
