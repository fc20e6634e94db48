"""What splitting needs to know about the nodes of a traced graph: kinds, owners, positions.

Every node of a ``torch.fx`` graph is one of two kinds here:

* **recomputable**: a parameter or buffer read (``get_attr``) or a *shape value*, a non-tensor
  computed from tensors' metadata (``x.size(1)``, ``x.shape``, ``C // n_head``). These are cheap and
  pure, so they never cross a stage boundary: every stage that needs one recomputes it (reading the
  attribute, or taking the size of a tensor it has). This keeps integers out of the activations
  that travel between stages and keeps each parameter in the stage that uses it.
* **positioned**: everything else (placeholders, module calls, tensor operations, the output). The
  graph's node order is an execution order; a split cuts it into contiguous ranges, one per stage.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable

from torch import fx, nn

__all__ = [
    "ModulePositions",
    "is_compute",
    "is_recomputable",
    "is_shape_value",
    "module_paths",
    "positioned_nodes",
    "recomputed",
]

_SHAPE_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "element_size", "get_device", "stride",
     "is_contiguous", "is_floating_point", "is_complex"}
)
_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"})
_SCALAR_FUNCTIONS = frozenset(
    {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
     operator.truediv, operator.mod, operator.pow, operator.neg, operator.pos, operator.abs,
     operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
     operator.and_, operator.or_, operator.not_, operator.index, int, float, bool, min, max}
)


def is_shape_value(node: fx.Node) -> bool:
    """Whether ``node`` computes a non-tensor from tensor metadata (sizes and arithmetic on them)."""
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) >= 2 and node.args[1] in _SHAPE_ATTRS
    if node.target not in _SCALAR_FUNCTIONS and getattr(node.target, "__module__", None) != "math":
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(is_shape_value(n) for n in inputs)


def recomputed(fn: Any) -> Any:
    """Mark ``fn``, a function a traced graph calls, as cheap and pure like a shape value: every
    stage that needs its result computes it again from values the stage has, so its result (a bool,
    say) never crosses a boundary. (The transformer stacks' causal-mask detection, see
    :mod:`pipetrain.stages.trace`.)"""
    fn.pipetrain_recomputed = True
    return fn


def is_recomputable(node: fx.Node) -> bool:
    """A parameter/buffer read, a shape value or a :func:`recomputed` function: recomputed in
    each stage that needs it."""
    return (node.op == "get_attr" or is_shape_value(node)
            or (node.op == "call_function" and getattr(node.target, "pipetrain_recomputed", False)))


def is_compute(node: fx.Node) -> bool:
    """A positioned node that does work (not a placeholder, not the output)."""
    return node.op in ("call_module", "call_function", "call_method") and not is_recomputable(node)


def positioned_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that a split assigns to stages by position, in execution order."""
    return [n for n in graph.nodes if not is_recomputable(n)]


def module_paths(node: fx.Node) -> list[str]:
    """Qualified names of the modules whose ``forward`` produced ``node`` (outermost first)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [value[0] for value in stack.values() if value and value[0]]
    if node.op == "call_module":
        target = str(node.target)
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in paths:
                paths.append(prefix)
    return paths


@dataclass
class ModulePositions:
    """Where each module's work lies in the positioned node list: first and last index.

    ``first[name]`` / ``last[name]`` index the positioned compute nodes of module ``name``
    (qualified, as in ``model.named_modules()``); modules that do no work in ``forward`` are absent.
    ``leaves`` are the modules called as a whole (``call_module`` targets), whose insides cannot be
    split points.
    """

    first: dict[str, int]
    last: dict[str, int]
    leaves: set[str]

    @classmethod
    def of(cls, nodes: Iterable[fx.Node]) -> "ModulePositions":
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        leaves: set[str] = set()
        for i, node in enumerate(nodes):
            if not is_compute(node):
                continue
            if node.op == "call_module":
                leaves.add(str(node.target))
            for path in module_paths(node):
                first.setdefault(path, i)
                last[path] = i
        return cls(first, last, leaves)

    def children(self, model: nn.Module, name: str) -> list[str]:
        """Qualified names of the direct children of module ``name`` that do work, in run order."""
        module = model.get_submodule(name) if name else model
        prefix = f"{name}." if name else ""
        names = [prefix + child for child, _ in module.named_children()]
        return sorted((n for n in names if n in self.first), key=lambda n: self.first[n])

    def enclosing_leaf(self, name: str) -> str | None:
        """The leaf module that contains module ``name`` (strictly), if any."""
        parts = name.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in self.leaves:
                return prefix
        return None
