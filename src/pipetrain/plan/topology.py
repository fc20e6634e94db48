"""Machine topologies: levels of components, each joined by its own bandwidth."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.errors import ConfigError, option

__all__ = ["Topology", "DEFAULT_BANDWIDTH"]

DEFAULT_BANDWIDTH = 1e9  # bytes per second, as in PipeDream's optimizer


@dataclass(frozen=True)
class Topology:
    """``machines[l]`` components at level ``l`` (innermost first) joined by ``bandwidths[l]`` B/s.

    ``Topology((4, 4), (10e9, 1.25e9))`` is 4 servers of 4 GPUs: GPUs in a server talk at 10 GB/s,
    servers at 1.25 GB/s. A flat cluster of N workers is ``Topology((N,), (bandwidth,))``.
    """

    machines: tuple[int, ...]
    bandwidths: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.machines or len(self.machines) != len(self.bandwidths):
            raise ConfigError("a topology needs one bandwidth per level")
        for count in self.machines:
            if int(count) != count or count < 1:
                raise ConfigError(f"topology level sizes must be integers >= 1, got {count}")
        for bandwidth in self.bandwidths:
            if not bandwidth > 0:
                raise ConfigError(f"bandwidths must be positive (bytes per second), got "
                                  f"{bandwidth}")

    @property
    def workers(self) -> int:
        return math.prod(self.machines)

    @property
    def levels(self) -> int:
        return len(self.machines)

    def describe(self) -> str:
        if self.levels == 1:
            return f"{self.workers} workers at {self.bandwidths[0]:.3g} B/s"
        parts = " x ".join(str(m) for m in self.machines)
        bws = ", ".join(f"{b:.3g}" for b in self.bandwidths)
        return f"{parts} (innermost first; {bws} B/s)"

    @classmethod
    def flat(cls, workers: int, bandwidth: float = DEFAULT_BANDWIDTH) -> "Topology":
        return cls((int(workers),), (float(bandwidth),))

    @classmethod
    def parse(cls, workers: int | None, topology: str | None = None,
              bandwidth: str | None = None) -> "Topology":
        """Build from ``--workers N --topology AxB --bandwidth b1,b2`` (innermost level first)."""
        if workers is not None and (int(workers) != workers or workers < 1):
            raise ConfigError(f"{option('workers')} must be an integer >= 1, got {workers}")
        if topology:
            try:
                machines = tuple(int(part) for part in topology.lower().split("x"))
            except ValueError:
                raise ConfigError(f"cannot read topology {topology!r}; write level sizes "
                                  "innermost first, e.g. 4x4 for 4 servers of 4 GPUs") from None
            if any(m < 1 for m in machines):
                raise ConfigError(f"topology {topology!r}: every level needs at least 1 component")
            if workers is not None and math.prod(machines) != workers:
                raise ConfigError(
                    f"topology {topology} has {math.prod(machines)} workers "
                    f"({' * '.join(map(str, machines))}) but {option('workers')} is {workers}; make the "
                    "product of the level sizes equal the worker count")
        else:
            if workers is None:
                raise ConfigError(f"give {option('workers')}, the number of workers (and optionally {option('topology', 'AxB')})")
            machines = (int(workers),)
        if bandwidth:
            try:
                bws = tuple(float(part) for part in bandwidth.split(","))
            except ValueError:
                raise ConfigError(f"cannot read bandwidth {bandwidth!r}; write bytes per second, "
                                  "innermost level first, e.g. 10e9,1.25e9") from None
            if len(bws) == 1 and len(machines) > 1:
                bws = bws * len(machines)
            if len(bws) != len(machines):
                raise ConfigError(
                    f"{len(bws)} bandwidths for a {len(machines)}-level topology; give one "
                    "bandwidth per level (innermost first) or a single one for all levels")
        else:
            bws = (DEFAULT_BANDWIDTH,) * len(machines)
        return cls(machines, bws)
