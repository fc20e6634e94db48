"""The two halves of a split backward (I, then W) without computing any gradient twice.

I differentiates the stage's roots with respect to its inputs only. The nodes it runs are the
*input part* of the graph: those on a path from the roots to an input. Every weight gradient
enters the rest of the graph (the *weight part*) along an edge out of an input-part node, its
*boundary* node (a Linear's ``addmm``: its input gradient is I's, its weight gradient W's). I keeps
the gradient each boundary node receives (a pre-hook), and drops the roots, so that the nodes above
the boundaries (and their saved tensors) go at once. W starts from the kept gradients: it runs each
boundary node again asking only for its weight-side outputs, and the weight part below it, once.

W runs one engine call per *group*: the parameters whose weight parts meet (shared boundary nodes
or weight-part nodes), so that a call asks a boundary node for nothing that leads to another
group's parameters; a boundary node that another of its group's boundary nodes reaches through the
input part gets, by a pre-hook, exactly the gradient I kept (nothing is added twice). Parameters
are autograd leaves as in a full backward, so the engine adds into their ``.grad`` (the running
sums) and fires their hooks exactly as there.

Bitwise the same as a full backward: each node computes the same values from the same incoming
gradients; what could differ is the order in which the engine adds the contributions a weight-part
node receives. Two contributions add the same either way round; a weight-part node that receives
three or more could add them in another order, so :func:`plan` refuses such a graph and the stage
runs that microbatch as before (I from the roots to the inputs keeping the graph, W a second
backward from the roots to the weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightHalf", "input_half"]


@dataclass
class _Group:
    """Parameters whose weight parts meet, their boundary nodes, and the roots outside the input part
    whose gradients reach them."""

    leaves: list[Tensor] = field(default_factory=list)
    boundary: list[Node] = field(default_factory=list)
    roots: list[tuple[GradientEdge, Tensor]] = field(default_factory=list)


@dataclass
class WeightHalf:
    """What I keeps for W: per group, the gradients its boundary nodes received."""

    groups: list[_Group]
    kept: dict[Node, tuple]  # boundary node -> the gradients it received in I
    owner: tuple = ()  # the roots, kept only where a boundary node does not own its graph (a Python Function)

    def run(self) -> None:
        """W: the weight gradients, added into the leaves' ``.grad``; run it once."""
        for group in self.groups:
            edges: list[GradientEdge] = []
            grads: list[Tensor] = []
            for node in group.boundary:
                for index, grad in enumerate(self.kept.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            for edge, grad in group.roots:
                edges.append(edge)
                grads.append(grad)
            if not edges:
                continue  # nothing reached these parameters on this microbatch: no gradient, as in a full backward
            handles = []
            if len(group.boundary) > 1:  # one may reach another through the input part: that one gets I's gradient
                for node in group.boundary:
                    handles.append(node.register_prehook(_clamp(self.kept.get(node))))
            try:
                torch.autograd.backward(edges, grads, inputs=group.leaves, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()
        self.groups, self.kept, self.owner = [], {}, ()


def _clamp(kept: tuple | None):
    def hook(grad_outputs: Sequence[Tensor | None]) -> tuple:
        return kept if kept is not None else tuple(None for _ in grad_outputs)
    return hook


def _node(tensor: Tensor) -> Node:
    return get_gradient_edge(tensor).node


def plan(roots: Sequence[Tensor], grads: Sequence[Tensor] | None, inputs: Sequence[Tensor],
         leaves: Sequence[Tensor]) -> list[_Group] | None:
    """The groups W will run, or ``None`` where the split cannot promise a full backward's bits
    (see the module docstring) or has nothing to split (no inputs)."""
    if not inputs:
        return None
    parents: dict[Node, list[Node]] = {}  # node -> the nodes with an edge to it (one entry per edge)
    root_nodes = [_node(r) for r in roots]
    stack = []
    for node in root_nodes:
        if node not in parents:
            parents[node] = []
            stack.append(node)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    input_part: set[Node] = set()
    stack = [n for n in (_node(x) for x in inputs) if n in parents]
    input_part.update(stack)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in input_part:
                input_part.add(parent)
                stack.append(parent)
    outside_roots: dict[Node, list[tuple[GradientEdge, Tensor]]] = {}
    for index, (root, node) in enumerate(zip(roots, root_nodes)):
        if node not in input_part:
            if grads is None:
                return None  # a loss that no input reaches: nothing to gain, keep the plain path
            outside_roots.setdefault(node, []).append((get_gradient_edge(root), grads[index]))
    # union-find over the parameters, joined by any node their weight parts share
    owner: dict[Node, int] = {}
    link: list[int] = []

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    reached: list[tuple[Tensor, set[Node], set[Node]]] = []  # per used leaf: boundary, outside roots
    for leaf in leaves:
        start = _node(leaf)
        if start not in parents:
            continue  # unused on this microbatch
        if start in input_part:
            return None  # a weight that is an input as well: keep the plain path
        me = len(link)
        link.append(me)
        boundary: set[Node] = set()
        tops: set[Node] = set()
        seen = {start}
        stack = [start]
        while stack:
            node = stack.pop()
            if len(parents[node]) > 2:
                return None  # three or more contributions: their order could change
            if node in owner:
                link[find(owner[node])] = find(me)
            else:
                owner[node] = me
            if node in outside_roots:
                tops.add(node)
            for parent in parents[node]:
                if parent in input_part:
                    boundary.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        for node in boundary:
            if node in owner:
                link[find(owner[node])] = find(me)
            else:
                owner[node] = me
        reached.append((leaf, boundary, tops))
    groups: dict[int, _Group] = {}
    for i, (leaf, boundary, tops) in enumerate(reached):
        group = groups.setdefault(find(i), _Group())
        group.leaves.append(leaf)
        group.boundary.extend(n for n in boundary if n not in group.boundary)
        for node in tops:
            if not any(node is _edge.node for _edge, _ in group.roots):
                group.roots.extend(outside_roots[node])
    return list(groups.values())


def input_half(roots: Sequence[Tensor], grads: Sequence[Tensor] | None, inputs: Sequence[Tensor],
               leaves: Sequence[Tensor]) -> tuple[Sequence[Tensor | None], WeightHalf | None]:
    """I: the gradients of ``inputs`` and what W needs (``None``: W must be a second backward from the
    roots, which the caller then keeps)."""
    groups = plan(roots, grads, inputs, leaves)
    if groups is None:
        return torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True), None
    kept: dict[Node, tuple] = {}
    boundary = {node for group in groups for node in group.boundary}
    handles = [node.register_prehook(_keeper(kept, node)) for node in boundary]
    try:
        results = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    python_nodes = any(isinstance(node, torch._C._FunctionBase) for node in boundary)
    return results, WeightHalf(groups, kept, tuple(roots) if python_nodes else ())


def _keeper(kept: dict[Node, Any], node: Node):
    def hook(grad_outputs: Sequence[Tensor | None]) -> None:
        kept[node] = tuple(grad_outputs)
    return hook
