"""Tracing a model with torch.fx, with errors that name the call that could not be traced.

``torch.fx.symbolic_trace`` runs ``forward`` on proxies and records every tensor operation. It
cannot follow Python control flow that depends on tensor *values* (``if x.sum() > 0``), data-dependent
shapes, or calls into code it cannot see. When that happens inside a submodule, that submodule can
be made a **leaf** (called as a whole, never looked into) and the rest of the model still traces.

torch.nn layers are leaves, except the containers: ``nn.Sequential`` and ``nn.ModuleList`` (as in
fx) and the transformer stacks: ``nn.Transformer`` is traced as its encoder then its decoder, and
``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` as the loop over their layers (and the final
norm) that their ``forward`` runs, with or without masks; so a split can fall between two layers
of an encoder or a decoder, and the encoder's output and the masks travel to the decoder's stages.
What their ``forward`` decides from a mask's values (whether it is causal) is decided at run time,
in each stage, from the real mask (:func:`_layer_loop`).

Forward parameters with a non-tensor default (``mask=None``, ``causal=True``) are fixed to that
default (fx ``concrete_args``), so that ``if mask is not None`` takes the branch the default takes;
``concrete_args`` overrides the value. The traced model's remaining parameters are its tensor inputs.
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Mapping, Sequence

import torch
from torch import fx, nn
from torch.nn import functional as F
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

from pipetrain.errors import ConfigError, PipetrainError, option
from pipetrain.stages.nodes import recomputed
from pipetrain.usercode import user_frame

__all__ = ["default_concrete_args", "resolve_leaf_modules", "trace_model"]

class _Tracer(fx.Tracer):
    """The default tracer, plus leaves named by qualified name or class name, and transformer
    stacks opened into their layers."""

    def __init__(self, leaf_names: set[str], leaf_types: set[type]):
        super().__init__()
        self.leaf_names = leaf_names
        self.leaf_types = leaf_types
        self._opened: list[nn.Module] = []

    def is_user_leaf(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaf_names or type(m) in self.leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.is_user_leaf(m, module_qualified_name):
            return True
        if self._opened and m is self._opened[-1]:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        opened = None if self.is_user_leaf(m, self.path_of_module(m)) else _layer_loop(self, m, args, kwargs)
        if opened is None:
            return super().call_module(m, forward, args, kwargs)
        self._opened.append(m)
        try:
            return super().call_module(m, opened, args, kwargs)
        finally:
            self._opened.pop()


@recomputed
def encoder_is_causal(mask: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> bool:
    """What ``nn.TransformerEncoder.forward`` passes its layers as ``is_causal`` when given a mask
    and no hint: whether the mask, made canonical as it makes it, is the causal mask of the sequence
    (torch's own functions, on the real mask at run time)."""
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="",
                             target_type=hidden.dtype, check_other=False)
    return _detect_is_causal_mask(mask, None, _get_seq_len(hidden, batch_first))


@recomputed
def decoder_is_causal(mask: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> bool:
    """What ``nn.TransformerDecoder.forward`` passes its layers as ``tgt_is_causal`` when given a
    ``tgt_mask`` and no hint (torch's own detection, at run time)."""
    return _detect_is_causal_mask(mask, None, _get_seq_len(hidden, batch_first))


def _causal(tracer: fx.Tracer, detect: Any, mask: Any, hint: Any, hidden: Any, batch_first: bool) -> Any:
    """The ``is_causal`` a layer receives: the hint (True, False) or without a mask False, as torch
    decides it; for a mask without a hint, a node that detects it at run time in every stage that
    needs it (:func:`~pipetrain.stages.nodes.recomputed`), so that no bool crosses a boundary."""
    if hint is not None or mask is None:
        return hint is True
    return tracer.create_proxy("call_function", detect, (mask, hidden, batch_first), {})


def _layer_loop(tracer: fx.Tracer, m: nn.Module, args: tuple, kwargs: dict) -> Any:
    """For ``nn.Transformer``, ``nn.TransformerEncoder`` and ``nn.TransformerDecoder``, a function
    computing what their ``forward`` computes in training: the encoder then the decoder; each
    layer in turn, then the norm. Else None.

    Each layer gets the masks as given (it makes them canonical itself, as the stack would) and the
    ``is_causal`` the stack's ``forward`` would give it (:func:`_causal`). Left out: the nested-tensor
    fast path of ``TransformerEncoder``, which torch takes only outside training (in eval mode
    without autograd, with a key padding mask), and ``nn.Transformer``'s checks of batch and feature
    sizes. In training (and in eval mode with autograd) the opened stack is bitwise the module.
    """
    if type(m) not in (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder):
        return None
    try:
        bound = inspect.signature(m.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    given = dict(bound.arguments)
    if isinstance(m, nn.Transformer):
        def transformer(*_: Any, **__: Any) -> Any:
            memory = m.encoder(given["src"], mask=given["src_mask"], src_key_padding_mask=given["src_key_padding_mask"],
                               is_causal=given["src_is_causal"])
            return m.decoder(given["tgt"], memory, tgt_mask=given["tgt_mask"], memory_mask=given["memory_mask"],
                             tgt_key_padding_mask=given["tgt_key_padding_mask"],
                             memory_key_padding_mask=given["memory_key_padding_mask"],
                             tgt_is_causal=given["tgt_is_causal"], memory_is_causal=given["memory_is_causal"])

        return transformer
    batch_first = m.layers[0].self_attn.batch_first
    if isinstance(m, nn.TransformerEncoder):
        def encoder(*_: Any, **__: Any) -> Any:
            out, mask = given["src"], given["mask"]
            for layer in m.layers:
                causal = _causal(tracer, encoder_is_causal, mask, given["is_causal"], out, batch_first)
                out = layer(out, src_mask=mask, is_causal=causal, src_key_padding_mask=given["src_key_padding_mask"])
            return out if m.norm is None else m.norm(out)

        return encoder

    def decoder(*_: Any, **__: Any) -> Any:
        out, mask = given["tgt"], given["tgt_mask"]
        for layer in m.layers:
            causal = _causal(tracer, decoder_is_causal, mask, given["tgt_is_causal"], out, batch_first)
            out = layer(out, given["memory"], tgt_mask=mask, memory_mask=given["memory_mask"],
                        tgt_key_padding_mask=given["tgt_key_padding_mask"],
                        memory_key_padding_mask=given["memory_key_padding_mask"], tgt_is_causal=causal,
                        memory_is_causal=given["memory_is_causal"])
        return out if m.norm is None else m.norm(out)

    return decoder


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
    """`` at file:line `code``` of the innermost traceback frame in the user's code
    (:func:`pipetrain.usercode.user_frame`), or ""."""
    frame = user_frame(error)
    if frame is None:
        return ""
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
            f"Make that module a leaf, called as a whole ({option('leaf_modules', [inner])}; its class name "
            f"works too): a leaf cannot "
            f"be cut inside, so choose split points outside it"
            + (f", e.g. {', '.join(around)}" if around else "")
            + "; or return a list of stage modules from your model factory"
        )
    children = [n for n, _ in model.named_children()][:8]
    return (
        f"{head}: the call that failed is in {type(model).__name__}.forward itself{where}: {detail}. "
        f"Return a list of stage modules from your model factory (each called as stage(*inputs)), "
        f"or an nn.Sequential of its parts"
        + (f" (its top-level modules are {', '.join(children)})" if children else "")
        + "; non-tensor forward arguments can be fixed with concrete_args" + _hf_hint(model)
    )


#: HuggingFace classes whose blocks pipetrain.models declares (named here as text: stages sit below models)
_HF_UNITS = {"GPT2LMHeadModel": "pipetrain.models.hf.gpt2_units", "BertForMaskedLM": "pipetrain.models.hf.bert_units",
             "T5ForConditionalGeneration": "pipetrain.models.hf_seq2seq.t5_units",
             "BartForConditionalGeneration": "pipetrain.models.hf_seq2seq.bart_units"}


def _hf_hint(model: nn.Module) -> str:
    """For a HuggingFace model whose forward does not trace: how to cut it at its blocks instead."""
    units = _HF_UNITS.get(type(model).__name__)
    if units is None or not type(model).__module__.startswith("transformers."):
        return ""
    return (f". For this HuggingFace model, declare its blocks as the units instead of tracing: "
            f"pipetrain.models.hf.declare_units(model, {units.rpartition('.')[2]}(model), loss=...) with "
            f"{units} (docs/models.md)")


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
