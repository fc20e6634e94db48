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
    ideal ``j``; likewise ``params``, ``optimizer``, ``activations`` (bytes); ``output[j]`` the
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
    import heapq
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
        return members.astype(np.float64) @ values

    return Cuts(profile=profile, nodes=keep, members=members, compute=sums(compute),
                params=sums(params), optimizer=sums(optim), activations=sums(acts),
                output=output, ancestors=ancestors, chain=chain, inputs=inputs, tails=tails,
                layer_activations=acts, successors=succ, augment=extra)


def _dag_states(n: int, pred_idx: list[list[int]], succ_idx: list[list[int]],
                acts: np.ndarray) -> tuple[np.ndarray, ...]:
    down = [0] * n                      # node and all its ancestors, as bit masks
    for v in range(n):                  # indices are in topological order
        mask = 1 << v
        for p in pred_idx[v]:
            mask |= down[p]
        down[v] = mask
    succ_mask = [sum(1 << s for s in succ_idx[v]) for v in range(n)]
    sources = [v for v in range(n) if not pred_idx[v]]
    start = down[sources[0]]
    seen = {start: 0}
    states = [start]
    queue = [start]
    limit = 200_000
    while queue:
        ideal = queue.pop(0)
        frontier = 0
        bits = ideal
        while bits:
            low = bits & -bits
            frontier |= succ_mask[low.bit_length() - 1]
            bits ^= low
        frontier &= ~ideal
        bits = frontier
        while bits:
            low = bits & -bits
            bits ^= low
            nxt = ideal | down[low.bit_length() - 1]
            if nxt not in seen:
                seen[nxt] = len(states)
                states.append(nxt)
                queue.append(nxt)
                if len(states) > limit:
                    raise ConfigError(
                        f"the layer graph has more than {limit} cut points (too many parallel "
                        "branches); merge branches into single layers in the profile")
    full = (1 << n) - 1
    if full not in seen:
        raise ConfigError("some layers of the profile are not connected to the first layer; "
                          "a profile must describe one connected model")
    states.sort(key=lambda mask: bin(mask).count("1"))
    states = [0] + states
    nbytes = (n + 7) // 8
    raw = np.frombuffer(b"".join(m.to_bytes(nbytes, "little") for m in states), dtype=np.uint8)
    members = np.unpackbits(raw.reshape(len(states), nbytes), axis=1,
                            bitorder="little")[:, :n].astype(bool)
    m32 = members.astype(np.float32)
    outside = (1.0 - m32).T
    not_subset = m32 @ outside          # layers of k not in j
    ancestors = (not_subset == 0) & ~np.eye(len(states), dtype=bool)
    succ = np.zeros((n, n), dtype=np.float32)
    for v in range(n):
        succ[v, succ_idx[v]] = 1.0
    has_succ_inside = (m32 @ succ.T) > 0    # (state, v): some successor of v is in the ideal
    maximal = members & ~has_succ_inside
    extra = np.zeros((n, n), dtype=np.float32)  # extra[a, p]: p joins a's augmented antichain
    for a in range(n):
        anc = down[a] & ~(1 << a)
        keep_in = anc | (1 << a)
        bits = anc
        while bits:
            low = bits & -bits
            bits ^= low
            p = low.bit_length() - 1
            if succ_mask[p] & ~keep_in:
                extra[a, p] = 1.0
    augmented = maximal | ((maximal.astype(np.float32) @ extra) > 0)
    output = augmented.astype(np.float64) @ acts
    return members, ancestors, output, succ, extra
