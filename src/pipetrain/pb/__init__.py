"""Pipelined Backpropagation: exact reference, fast batched engine, and the PB study."""

from pipetrain.pb.engine import BatchedPB
from pipetrain.pb.groups import NotBatchable
from pipetrain.pb.latest import LatestWeights
from pipetrain.pb.lowering import lower, register_lowering
from pipetrain.pb.methods import Method, parse_method, parse_methods
from pipetrain.pb.reference import ReferenceResult, pb_sequential, pb_ticks
from pipetrain.pb.study import RunResult, RunSpec, StudyConfig, StudyResult, run_study

__all__ = [
    "BatchedPB",
    "LatestWeights",
    "Method",
    "NotBatchable",
    "ReferenceResult",
    "RunResult",
    "RunSpec",
    "StudyConfig",
    "StudyResult",
    "lower",
    "parse_method",
    "parse_methods",
    "pb_sequential",
    "pb_ticks",
    "register_lowering",
    "run_study",
]
