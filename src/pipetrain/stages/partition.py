"""Choosing a balance: how many consecutive modules each stage gets.

A *balance* is a list of positive module counts, one per stage, summing to the number of
top-level modules: ``[2, 2, 1]`` puts modules 0-1 in stage 0, 2-3 in stage 1 and 4 in stage 2.
:func:`balance_by_params` picks one that minimises the largest stage's parameter count.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from pipetrain.errors import ConfigError, option

__all__ = ["balance_by_params", "check_balance", "check_stages", "parameter_counts", "partition_min_max"]


def parameter_counts(modules: nn.Sequential | Sequence[nn.Module]) -> list[int]:
    """Number of parameter elements of each top-level module (buffers not counted)."""
    return [sum(p.numel() for p in module.parameters()) for module in modules]


def check_balance(balance: Sequence[int], num_modules: int) -> list[int]:
    """``balance`` as a list of ints, or a ConfigError explaining what a balance must be."""
    balance = list(balance)
    if not balance:
        raise ConfigError(f"{option('balance')} is empty: give one module count per stage, e.g. {option('balance', [2, 2, 1])}")
    for count in balance:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(
                f"{option('balance', balance)}: every entry is the number of "
                f"consecutive modules of one stage and must be a positive integer, got {count!r}"
            )
    if sum(balance) != num_modules:
        raise ConfigError(
            f"{option('balance', balance)} adds up to {sum(balance)} but the model has "
            f"{num_modules} top-level modules; the entries must add up to {num_modules} "
            f"(or give {option('stages')}, a stage count, to balance by parameter count)"
        )
    return balance


def _fewest_parts(weights: Sequence[int], limit: int) -> int:
    parts, current = 1, 0
    for w in weights:
        if current + w > limit:
            parts, current = parts + 1, 0
        current += w
    return parts


def partition_min_max(weights: Sequence[int], parts: int) -> list[int]:
    """Split ``weights`` into ``parts`` non-empty contiguous blocks; return the block sizes.

    First the largest block sum is minimised (exactly: binary search with a greedy check). Among
    the partitions that reach it, the one with the smallest sum of squared block sums is taken,
    then the smallest sum of squared block sizes (remaining ties broken deterministically): so equal weights give
    sizes that differ by at most one, and zero-weight modules are spread out.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot split {n} modules into {parts} non-empty stages (at most {n})")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    low, high = max(weights), sum(weights)
    while low < high:
        middle = (low + high) // 2
        if _fewest_parts(weights, middle) <= parts:
            high = middle
        else:
            low = middle + 1
    limit = low
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    scale = n * n + 1  # sum of squared sizes is at most n*n: encode both keys in one integer
    inf = None
    # best[k][j]: (cost, previous cut) of the first j modules in k blocks
    best: list[list[tuple[int, int] | None]] = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            choice: tuple[int, int] | None = None
            for i in range(j - 1, k - 2, -1):
                block = prefix[j] - prefix[i]
                if block > limit:
                    break
                previous = best[k - 1][i]
                if previous is None:
                    continue
                cost = previous[0] + block * block * scale + (j - i) * (j - i)
                if choice is None or cost <= choice[0]:
                    choice = (cost, i)
            best[k][j] = choice
    sizes: list[int] = []
    j = n
    for k in range(parts, 0, -1):
        entry = best[k][j]
        assert entry is not None
        sizes.append(j - entry[1])
        j = entry[1]
    return sizes[::-1]


def balance_by_params(model: nn.Sequential | Sequence[nn.Module], stages: int) -> list[int]:
    """A balance of ``stages`` stages for the top-level modules of ``model`` by parameter count."""
    check_stages(stages, len(model))
    return partition_min_max(parameter_counts(model), stages)


def check_stages(stages: int, n: int) -> None:
    """Refuse a stage count that is not a positive integer or exceeds the ``n`` top-level modules."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"{option('stages')} must be a positive integer, got {stages!r}")
    if stages > n:
        raise ConfigError(
            f"cannot split a model of {n} top-level modules into {stages} stages: every stage needs "
            f"at least one module, so use {option('stages', n)} or fewer (or a deeper model, e.g. "
            f"mlp:depth=... / resmlp:depth=...)"
        )
