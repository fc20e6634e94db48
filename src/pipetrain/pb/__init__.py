"""Pipelined Backpropagation: exact reference, fast batched engine, and the PB study."""

from pipetrain.pb.latest import LatestWeights
from pipetrain.pb.reference import ReferenceResult, pb_sequential, pb_ticks

__all__ = ["LatestWeights", "ReferenceResult", "pb_sequential", "pb_ticks"]
