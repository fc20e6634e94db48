"""Cut points of a layer graph: the states a pipeline partitioner moves between.

A pipeline stage of a DAG model is the set of layers between two cuts. A cut is a down-closed set
of layers (an *ideal*: every layer in it has all its predecessors in it too); the layers that feed
layers outside it form an antichain. For a chain the ideals are just the prefixes. PipeDream's
optimizer enumerates the ideals reachable from the first layer by adding a layer that consumes
something already inside together with everything that layer depends on; stage ``k -> j`` is
``ideal_j - ideal_k`` for ``ideal_k`` a proper subset of ``ideal_j``.

The activation sent across a cut follows PipeDream's *augmented antichain*: the antichain itself
plus, for each of its layers ``a``, every predecessor of ``a`` with an edge leaving the
predecessors of ``a`` (other than to ``a``). For a chain that is the last layer's output.

Input layers (the data source) are taken out before cutting and belong to stage 0; sinks whose
kind starts with ``__getitem__`` (tuple unpacking of the last output) are taken out too and join
the stage of their producer, as in PipeDream's optimizer.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from pipetrain.errors import ConfigError
from pipetrain.plan.profile import Profile

__all__ = ["Cuts", "build_cuts"]


@dataclass
class Cuts:
    """States (ideals) of a profile in topological order, with prefix sums over each ideal.

    State 0 is the empty ideal (before the first layer), the last state is the whole model. Arrays
    have one entry per state: ``compute[j]`` is the forward plus backward time of all layers in
    ideal ``j``, ``forward[j]`` their forward time alone (what activation recomputation runs
    again); likewise ``params``, ``optimizer``, ``activations`` (bytes); ``output[j]`` the
    bytes sent across cut ``j``. ``ancestors[k, j]`` is true when ideal ``k`` is a proper subset of
    ideal ``j`` (so ``k -> j`` is a valid stage). For a chain, state ``j`` is the first ``j``
    layers along the chain.
    """

    profile: Profile
    nodes: list[str]            # planned layers (inputs and __getitem__ sinks taken out)
    members: np.ndarray         # bool (states, nodes): layer in ideal
    compute: np.ndarray
    params: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    output: np.ndarray
    ancestors: np.ndarray
    chain: bool
    inputs: list[str]
    tails: dict[str, list[str]]  # removed __getitem__ sink -> its producers
    layer_activations: np.ndarray | None = None  # per planned layer
    successors: np.ndarray | None = None  # (layer, layer) adjacency, DAGs only
    augment: np.ndarray | None = None     # (layer, layer): p joins a's augmented antichain
    forward: np.ndarray | None = None     # per state, like compute: the forward time alone

    @property
    def num_states(self) -> int:
        return len(self.compute)

    def output_of(self, members: np.ndarray) -> np.ndarray:
        """Bytes sent across the cuts given as rows of a (cuts, layers) membership matrix.

        Any down-closed set of layers (a prefix of a topological order, for example) is a cut.
        """
        members = np.atleast_2d(members).astype(bool)
        if self.chain:
            count = members.sum(axis=1)
            acts = np.concatenate([[0.0], self.layer_activations])
            return acts[count]
        m32 = members.astype(np.float32)
        maximal = members & ~((m32 @ self.successors.T) > 0)
        augmented = maximal | ((maximal.astype(np.float32) @ self.augment) > 0)
        return augmented.astype(np.float64) @ self.layer_activations

    def stage_layers(self, k: int, j: int) -> list[str]:
        """Names of the planned layers of stage ``k -> j``, in topological order."""
        between = self.members[j] & ~self.members[k]
        return [name for name, inside in zip(self.nodes, between) if inside]


def _topological(names: list[str], preds: dict[str, list[str]],
                 succs: dict[str, list[str]]) -> list[str]:
    order_of = {name: i for i, name in enumerate(names)}
    indegree = {name: len(preds[name]) for name in names}
    ready = sorted((n for n in names if indegree[n] == 0), key=order_of.__getitem__)
    out: list[str] = []
    heap = [(order_of[n], n) for n in ready]
    heapq.heapify(heap)
    while heap:
        _, name = heapq.heappop(heap)
        out.append(name)
        for nxt in succs[name]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(heap, (order_of[nxt], nxt))
    if len(out) != len(names):
        stuck = [n for n in names if indegree[n] > 0][:5]
        raise ConfigError(f"the profile's layer graph has a cycle (through {', '.join(stuck)}); "
                          "a model's layer graph must be acyclic")
    return out


def build_cuts(profile: Profile) -> Cuts:
    """Enumerate the cut states of ``profile`` (PipeDream's antichain DAG, in topological order)."""
    layers = {layer.name: layer for layer in profile.layers}
    names = [layer.name for layer in profile.layers]
    edges = profile.edge_list()
    preds: dict[str, list[str]] = {n: [] for n in names}
    succs: dict[str, list[str]] = {n: [] for n in names}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    order = _topological(names, preds, succs)

    inputs = [n for n in names if layers[n].input]
    for name in inputs:
        if preds[name]:
            raise ConfigError(f"input layer {name!r} has incoming edges; an input layer is a data "
                              "source and must have none")
    keep = [n for n in order if not layers[n].input]
    kept = set(keep)
    tails: dict[str, list[str]] = {}
    for name in list(keep):
        real_succs = [s for s in succs[name] if s in kept]
        if not real_succs and layers[name].kind.startswith("__getitem__") and len(keep) > 1:
            tails[name] = [p for p in preds[name] if p in kept]
    keep = [n for n in keep if n not in tails]
    if not keep:
        raise ConfigError("the profile has no layers to plan (only inputs)")
    kept = set(keep)
    index = {name: i for i, name in enumerate(keep)}
    n = len(keep)
    pred_idx = [[index[p] for p in preds[name] if p in kept] for name in keep]
    succ_idx = [[index[s] for s in succs[name] if s in kept] for name in keep]
    compute = np.array([layers[name].compute_s for name in keep], dtype=np.float64)
    forward = np.array([layers[name].forward_s for name in keep], dtype=np.float64)
    params = np.array([layers[name].parameter_bytes for name in keep], dtype=np.float64)
    optim = np.array([layers[name].optimizer_bytes for name in keep], dtype=np.float64)
    acts = np.array([layers[name].activation_bytes for name in keep], dtype=np.float64)

    chain = all(len(p) <= 1 for p in pred_idx) and all(len(s) <= 1 for s in succ_idx) and \
        sum(1 for p in pred_idx if not p) == 1
    succ = extra = None
    if chain:
        # keep is topological, so along a chain it is the path order
        members = np.tri(n + 1, n, -1, dtype=bool)
        ancestors = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        output = np.concatenate([[0.0], acts])
    else:
        members, ancestors, output, succ, extra = _dag_states(n, pred_idx, succ_idx, acts)

    def sums(values: np.ndarray) -> np.ndarray:
        if chain:
            return np.concatenate([[0.0], np.cumsum(values)])
        return np.where(members, values[None, :], 0.0).sum(axis=1)

    return Cuts(profile=profile, nodes=keep, members=members, compute=sums(compute),
                params=sums(params), optimizer=sums(optim), activations=sums(acts),
                output=output, ancestors=ancestors, chain=chain, inputs=inputs, tails=tails,
                layer_activations=acts, successors=succ, augment=extra, forward=sums(forward))


def _pack(masks: list[int], bits: int) -> np.ndarray:
    """Python-int bit masks as rows of 64-bit words."""
    words = max(1, (bits + 63) // 64)
    raw = b"".join(m.to_bytes(words * 8, "little") for m in masks)
    return np.frombuffer(raw, dtype="<u8").reshape(len(masks), words)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    as_bytes = packed.astype("<u8").view(np.uint8).reshape(packed.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :bits].astype(bool)


def _dag_states(n: int, pred_idx: list[list[int]], succ_idx: list[list[int]],
                acts: np.ndarray) -> tuple[np.ndarray, ...]:
    """States, ancestor relation and cut bytes with bit masks (no BLAS: small products are slow
    with threaded BLAS on a busy machine)."""
    down = [0] * n                      # node and all its ancestors, as bit masks
    for v in range(n):                  # indices are in topological order
        mask = 1 << v
        for p in pred_idx[v]:
            mask |= down[p]
        down[v] = mask
    succ_mask = [sum(1 << s for s in succ_idx[v]) for v in range(n)]
    succ_down = [0] * n                 # successors of a node and of all its ancestors
    for v in range(n):
        mask = succ_mask[v]
        for p in pred_idx[v]:
            mask |= succ_down[p]
        succ_down[v] = mask
    sources = [v for v in range(n) if not pred_idx[v]]
    start = down[sources[0]]
    # each ideal with the successors of its layers: the frontier is their difference
    seen = {start: succ_down[sources[0]]}
    parents: dict[int, list[int]] = {start: []}
    queue = [start]
    limit = 200_000
    head = 0
    while head < len(queue):
        ideal = queue[head]
        head += 1
        reach = seen[ideal]
        bits = reach & ~ideal
        while bits:
            low = bits & -bits
            bits ^= low
            v = low.bit_length() - 1
            nxt = ideal | down[v]
            if nxt not in seen:
                seen[nxt] = reach | succ_down[v]
                parents[nxt] = []
                queue.append(nxt)
                if len(queue) > limit:
                    raise ConfigError(
                        f"the layer graph has more than {limit} cut points (too many parallel "
                        "branches); merge branches into single layers in the profile")
            parents[nxt].append(ideal)
    full = (1 << n) - 1
    if full not in seen:
        raise ConfigError("some layers of the profile are not connected to the first layer; "
                          "a profile must describe one connected model")
    states = [0] + sorted(queue, key=int.bit_count)
    index = {mask: i for i, mask in enumerate(states)}
    # a reachable ideal is a subset of another exactly when a path of single steps joins them
    children: list[list[int]] = [[] for _ in states]
    for i, mask in enumerate(states[1:], start=1):
        for parent in parents[mask]:
            children[index[parent]].append(i)
    above = [0] * len(states)
    for i in range(len(states) - 1, 0, -1):
        acc = 0
        for c in children[i]:
            acc |= above[c] | (1 << c)
        above[i] = acc
    above[0] = ((1 << len(states)) - 1) & ~1   # the empty cut precedes everything
    ancestors = _unpack(_pack(above, len(states)), len(states))
    members = _unpack(_pack(states, n), n)
    # maximal layers of each ideal: no successor inside it
    inside = np.zeros_like(members)
    for v in range(n):
        if succ_idx[v]:
            inside[:, v] = members[:, succ_idx[v]].any(axis=1)
    maximal = members & ~inside
    # extra[a, p]: p, an ancestor of a, feeds a layer that is neither a nor an ancestor of a, so
    # it joins a's augmented antichain (PipeDream's definition)
    closure_packed = _pack(down, n)
    succ_packed = _pack(succ_mask, n)
    strict = _unpack(closure_packed, n) & ~np.eye(n, dtype=bool)
    leaving = (succ_packed[:, None, :] & ~closure_packed[None, :, :]).any(axis=2)   # (p, a)
    extra = strict & leaving.T
    augmented = maximal.copy()
    for a in np.flatnonzero(extra.any(axis=1)):
        augmented |= maximal[:, a:a + 1] & extra[a][None, :]
    output = np.where(augmented, acts[None, :], 0.0).sum(axis=1)
    succ = np.zeros((n, n), dtype=np.float32)
    for v in range(n):
        succ[v, succ_idx[v]] = 1.0
    return members, ancestors, output, succ, extra.astype(np.float32)
