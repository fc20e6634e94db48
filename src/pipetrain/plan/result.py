"""A plan: layers grouped into stages, replicas per stage, predicted time and memory."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipetrain.plan.stage_memory import is_flush

__all__ = ["Stage", "Plan"]


@dataclass
class Stage:
    """One pipeline stage of a plan (for multi-level topologies: of the flattened plan)."""

    layers: list[str]
    replicas: int
    compute_s: float              # forward + backward of its layers on one worker, one minibatch
    time_s: float                 # predicted time per minibatch, replicas and all-reduce included
    parameter_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    input_transfer_s: float = 0.0  # receiving its input activations (and sending gradients back)
    memory_bytes: float | None = None
    replicas_per_level: tuple[int, ...] = ()
    input_bytes: float = 0.0      # activation bytes crossing the cut into this stage, per minibatch
    input_bandwidth: float = 0.0  # bandwidth of the topology level that cut crosses
    recompute: bool = False       # keeps only its input, runs its forward again in the backward
    recompute_s: float = 0.0      # that forward again, per minibatch on one worker (in time_s)

    def to_json(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "replicas": self.replicas,
                "replicas_per_level": list(self.replicas_per_level),
                "compute_s": self.compute_s, "time_s": self.time_s,
                "input_transfer_s": self.input_transfer_s, "input_bytes": self.input_bytes,
                "parameter_bytes": self.parameter_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activation_bytes": self.activation_bytes, "memory_bytes": self.memory_bytes,
                "recompute": self.recompute, "recompute_s": self.recompute_s}


@dataclass
class Plan:
    """The output of a partitioner.

    ``chunks``: stages each worker holds (the chunked schedules' plans cut the model into
    ``chunks * workers`` stages; ``stages`` lists them all, ``memory_bytes`` of each its worker's).

    ``predicted_time_per_minibatch`` is the steady-state time of the slowest stage (communication
    included, per the cost model); for schedules that flush (gpipe, 1f1b, zb-h1) the time per
    minibatch with the pipeline bubble is ``time_per_minibatch_with_bubble``.
    """

    method: str
    stages: list[Stage]
    predicted_time_per_minibatch: float
    workers: int
    schedule: str = "pipedream"
    microbatches: int = 1
    cost_model: str = "pipedream-code"
    topology: str = ""
    single_worker_time: float = math.nan
    data_parallel_time: float = math.nan
    solve_seconds: float = 0.0
    memory_limit: float | None = None
    chunks: int = 1               # stages per worker: 2 for the V and looped schedules' plans
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def replicas(self) -> list[int]:
        return [stage.replicas for stage in self.stages]

    @property
    def workers_used(self) -> int:
        return sum(self.replicas) // self.chunks

    @property
    def noam(self) -> int:
        """Minibatches admitted into the pipeline at once: ceil(workers / input-stage replicas)."""
        return -(-self.workers_used // self.stages[0].replicas)

    @property
    def time_per_minibatch_with_bubble(self) -> float:
        if not is_flush(self.schedule):
            return self.predicted_time_per_minibatch
        if self.chunks > 1:  # no closed form over every chunked order: the simulated time, when known
            return self.extra.get("simulated_time_per_minibatch", self.predicted_time_per_minibatch)
        m, s = self.microbatches, len(self.stages)
        return self.predicted_time_per_minibatch * (m + s - 1) / m

    def layer_to_stage(self) -> dict[str, int]:
        return {name: index for index, stage in enumerate(self.stages) for name in stage.layers}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "predicted_time_per_minibatch": self.predicted_time_per_minibatch,
            "replicas": self.replicas,
            "num_stages": len(self.stages),
            "stages": [stage.to_json() for stage in self.stages],
            "solve_seconds": self.solve_seconds,
            "workers": self.workers, "workers_used": self.workers_used, "noam": self.noam,
            "schedule": self.schedule, "microbatches": self.microbatches, "chunks": self.chunks,
            "time_per_minibatch_with_bubble": self.time_per_minibatch_with_bubble,
            "cost_model": self.cost_model, "topology": self.topology,
            "single_worker_time": self.single_worker_time,
            "data_parallel_time": self.data_parallel_time,
            "speedup_vs_single_worker": _ratio(self.single_worker_time,
                                               self.predicted_time_per_minibatch),
            "speedup_vs_data_parallel": _ratio(self.data_parallel_time,
                                               self.predicted_time_per_minibatch),
            "memory_limit": self.memory_limit,
            "peak_memory_bytes": max((s.memory_bytes or 0.0) for s in self.stages),
            "layer_to_stage": self.layer_to_stage(),
            "recompute_stages": [s for s, stage in enumerate(self.stages) if stage.recompute],
        }
        out.update(self.extra)
        return out


def _ratio(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b
