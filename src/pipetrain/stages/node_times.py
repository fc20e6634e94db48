"""Measuring per-node forward times of a traced model, as costs for an automatic split."""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
from torch import fx, nn

from pipetrain.errors import ConfigError
from pipetrain.stages.nodes import is_compute
from pipetrain.stages.trace import trace_model

__all__ = ["measure_node_costs"]


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, times: dict[str, float]):
        super().__init__(module)
        self.times = times

    def run_node(self, n: fx.Node) -> Any:
        if not is_compute(n):
            return super().run_node(n)
        start = time.perf_counter()
        result = super().run_node(n)
        self.times[n.name] = self.times.get(n.name, 0.0) + time.perf_counter() - start
        return result


def measure_node_costs(
    model: nn.Module,
    *example_inputs: torch.Tensor,
    repeats: int = 3,
    warmup: int = 1,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Mean forward seconds of each operation of ``model`` on ``example_inputs``, by fx node name.

    Pass the result as ``split_model(model, stages=S, costs=...)`` (with the same ``leaf_modules``
    and ``concrete_args``) to balance stages by time rather than by parameter count. Only forward
    time is measured (a backward usually costs about twice its forward); run with the thread count
    the training will use. Timings of a few microseconds are dominated by interpreter overhead, so
    this pays off for models whose layers take milliseconds.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, got {repeats!r}")
    traced = trace_model(model, leaf_modules=leaf_modules, concrete_args=concrete_args)
    times: dict[str, float] = {}
    for _ in range(warmup):
        _TimingInterpreter(traced, {}).run(*example_inputs)
    for _ in range(repeats):
        _TimingInterpreter(traced, times).run(*example_inputs)
    return {name: total / repeats for name, total in times.items()}
