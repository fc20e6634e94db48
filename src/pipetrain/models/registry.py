"""`--model` specs to modules: the built-in models and `PKG.MOD:FACTORY`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models.common import input_features
from pipetrain.models.gpt import gpt
from pipetrain.models.mlp import mlp
from pipetrain.models.resmlp import resmlp
from pipetrain.models.resnet import resnet_gn
from pipetrain.models.resnet_skip import resnet_gn_skip
from pipetrain.spec import Spec, call_factory, parse_spec, resolve_factory

__all__ = ["MODELS", "build_model"]

#: built-in model name -> builder ``(input_shape, num_classes, **options) -> nn.Module``.
#: ``mlp``, ``resmlp``, ``resnet-gn`` are ``nn.Sequential`` s of pipeline units; ``resnet-gn-skip``
#: and ``gpt`` are ordinary modules, cut by tracing.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt": gpt,
    "mlp": mlp,
    "resmlp": resmlp,
    "resnet-gn": resnet_gn,
    "resnet-gn-skip": resnet_gn_skip,
}


def build_model(
    spec: str | Spec,
    *,
    input_shape: Sequence[int] | int,
    num_classes: int | None,
    seed: int | None = None,
    meta: bool = False,
) -> nn.Module:
    """The model named by ``spec``, sized for samples of ``input_shape`` and ``num_classes`` (None:
    the targets are not class labels, and only a factory that does not ask for it can be built).

    A ``PKG.MOD:FACTORY`` is called with the spec's options, plus ``input_shape`` (a tuple),
    ``in_features`` (its product) and ``num_classes`` for those of these parameter names it
    declares (or all, if it takes ``**kwargs``). It may return an ``nn.Module`` or a list of
    modules, which becomes an ``nn.Sequential`` of them (one pipeline unit each).

    With ``seed``, parameters are initialised under ``torch.manual_seed(seed)`` without touching
    the caller's random state; without, from the current global state. With ``meta``, the builder
    runs under ``torch.device("meta")``: the model has shapes and no values (nor memory), for the
    ranks to materialise their stages (:mod:`pipetrain.stages.materialize`).
    """
    if not isinstance(spec, Spec):
        spec = parse_spec(spec, builtins=MODELS, kind="model")
    shape, features = input_features(input_shape)
    if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 1):
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}")
    if spec.is_builtin:
        if num_classes is None:
            raise ConfigError(
                f"model {spec.name!r} is a classifier sized by the data's class count, but the data's targets are "
                f"not integer class labels; build the model with a factory (PKG.MOD:FACTORY) whose module has a "
                f"pipeline_loss for these targets"
            )
        builder = MODELS[spec.name]  # type: ignore[index]
        extra: dict[str, Any] = {"input_shape": shape, "num_classes": num_classes}
        what = f"model {spec.name!r}"
    else:
        builder = resolve_factory(spec, kind="model")
        extra = {"input_shape": shape, "in_features": features}
        if num_classes is not None:  # targets that are not class labels have no class count
            extra["num_classes"] = num_classes
        what = f"model factory {spec.label}"
    if meta:
        with torch.device("meta"):
            model = call_factory(builder, spec.kwargs, extra=extra, what=what)
    elif seed is None:
        model = call_factory(builder, spec.kwargs, extra=extra, what=what)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = call_factory(builder, spec.kwargs, extra=extra, what=what)
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return nn.Sequential(*model)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{what} returned a {type(model).__name__}; it must return an nn.Module or a list of "
            f"nn.Module stages"
        )
    return model
