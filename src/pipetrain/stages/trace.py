"""Tracing a model with torch.fx, with errors that name the call that could not be traced.

``torch.fx.symbolic_trace`` runs ``forward`` on proxies and records every tensor operation. It
cannot follow Python control flow that depends on tensor *values* (``if x.sum() > 0``), data-dependent
shapes, or calls into code it cannot see. When that happens inside a submodule, that submodule can
be made a **leaf** (called as a whole, never looked into) and the rest of the model still traces.

Forward parameters with a non-tensor default (``mask=None``, ``causal=True``) are fixed to that
default (fx ``concrete_args``), so that ``if mask is not None`` takes the branch the default takes;
``concrete_args`` overrides the value. The traced model's remaining parameters are its tensor inputs.
"""

from __future__ import annotations

import difflib
import inspect
import os
import traceback
from typing import Any, Mapping, Sequence

import torch
from torch import fx, nn

from pipetrain.errors import ConfigError, PipetrainError

__all__ = ["default_concrete_args", "resolve_leaf_modules", "trace_model"]

_TORCH_DIR = os.path.dirname(torch.__file__)


class _Tracer(fx.Tracer):
    """The default tracer, plus leaves named by qualified name or class name."""

    def __init__(self, leaf_names: set[str], leaf_types: set[type]):
        super().__init__()
        self.leaf_names = leaf_names
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or type(m) in self.leaf_types:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def default_concrete_args(model: nn.Module) -> dict[str, Any]:
    """Forward parameters with a non-tensor default, fixed to it: ``{"mask": None, ...}``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    fixed: dict[str, Any] = {}
    for name, param in params.items():
        default = param.default
        if default is inspect.Parameter.empty or isinstance(default, torch.Tensor):
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        fixed[name] = default
    return fixed


def resolve_leaf_modules(model: nn.Module, leaf_modules: Sequence[str | type]) -> tuple[set[str], set[type]]:
    """Split ``leaf_modules`` into qualified module names and module classes (by class or its name)."""
    modules = dict(model.named_modules())
    classes = {type(m).__name__: type(m) for m in modules.values()}
    names: set[str] = set()
    types: set[type] = set()
    for item in leaf_modules:
        if isinstance(item, type):
            types.add(item)
        elif item in modules and item:
            names.add(item)
        elif item in classes:
            types.add(classes[item])
        else:
            close = difflib.get_close_matches(str(item), [*modules, *classes], n=3)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"leaf module {item!r} is neither a submodule name of the model nor the class name "
                f"of one of its submodules.{hint}"
            )
    return names, types


def _user_frame(error: BaseException) -> str:
    """``file:line: code`` of the innermost traceback frame outside torch, or ""."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__
    ]
    if not frames:
        return ""
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f" at {os.path.basename(frame.filename)}:{frame.lineno}{code}"


def _failure(model: nn.Module, tracer: _Tracer, error: Exception) -> str:
    stack = [value[0] for value in getattr(tracer, "module_stack", {}).values() if value and value[0]]
    detail = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    where = _user_frame(error)
    head = f"cannot trace {type(model).__name__} with torch.fx to cut it into stages"
    if stack:
        inner = stack[-1]
        parent, _, _ = inner.rpartition(".")
        siblings = [n for n, _ in (model.get_submodule(parent) if parent else model).named_children()]
        prefix = f"{parent}." if parent else ""
        around = [prefix + s for s in siblings if prefix + s != inner][:6]
        return (
            f"{head}: the call that failed is in module {inner!r} "
            f"({type(model.get_submodule(inner)).__name__}.forward){where}: {detail}. "
            f"Make that module a leaf, called as a whole (split_model(..., leaf_modules="
            f"[{inner!r}]) or its class name), and choose split points outside it"
            + (f", e.g. {', '.join(around)}" if around else "")
            + "; or return a list of stage modules from your model factory"
        )
    children = [n for n, _ in model.named_children()][:8]
    return (
        f"{head}: the call that failed is in {type(model).__name__}.forward itself{where}: {detail}. "
        f"Return a list of stage modules from your model factory (each called as stage(*inputs)), "
        f"or an nn.Sequential of its parts"
        + (f" (its top-level modules are {', '.join(children)})" if children else "")
        + "; non-tensor forward arguments can be fixed with concrete_args"
    )


def trace_model(
    model: nn.Module,
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> fx.GraphModule:
    """``model`` traced into a GraphModule whose submodules and parameters are ``model``'s own.

    ``leaf_modules`` are called as a whole (qualified names, classes or class names) besides
    torch.nn's own layers. A failure is a ConfigError naming the module and line that failed.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"cannot trace a {type(model).__name__}: the model must be an nn.Module")
    names, types = resolve_leaf_modules(model, leaf_modules)
    fixed = {**default_concrete_args(model), **dict(concrete_args or {})}
    tracer = _Tracer(names, types)
    try:
        graph = tracer.trace(model, concrete_args=fixed or None)
    except PipetrainError:
        raise
    except Exception as error:  # noqa: BLE001 - any tracing failure is explained to the user
        raise ConfigError(_failure(model, tracer, error)) from error
    _drop_fixed_inputs(model, graph, set(fixed))
    for node in graph.nodes:
        if isinstance(node.type, str):  # a postponed annotation ("torch.Tensor"): fx cannot pickle it
            node.type = None
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _drop_fixed_inputs(model: nn.Module, graph: fx.Graph, fixed: set[str]) -> None:
    """Remove the placeholders of fixed (concrete) arguments and the checks fx adds on them.

    fx keeps a fixed argument as an input with the original default and asserts at run time that
    the caller passes the fixed value; the stages take only the remaining (tensor) inputs.
    """
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for name, node in zip(names, placeholders):
        if name not in fixed:
            continue
        dependents: list[fx.Node] = []
        todo = list(node.users)
        while todo:
            user = todo.pop()
            if user not in dependents:
                dependents.append(user)
                todo.extend(user.users)
        if any(d.op == "output" for d in dependents):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for dependent in sorted(dependents, key=order.__getitem__, reverse=True):
            graph.erase_node(dependent)
        graph.erase_node(node)
