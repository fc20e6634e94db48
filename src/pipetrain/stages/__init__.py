"""Cutting models into pipeline stages and mapping stage state dicts back to the whole model."""

from pipetrain.stages.balance import StageChoice, unit_names, unit_pieces
from pipetrain.stages.node_times import measure_node_costs
from pipetrain.stages.partition import balance_by_params, check_balance, parameter_counts, partition_min_max
from pipetrain.stages.points import Plan, normalize_plan
from pipetrain.stages.split import balance_from_split_at, from_stages, split_model
from pipetrain.stages.staged import StagedModel, StageSequential, call_stage, run_stages
from pipetrain.stages.tied import TiedParameter, find_tied, refuse_tied
from pipetrain.stages.trace import trace_model

__all__ = [
    "Plan",
    "StageChoice",
    "StageSequential",
    "StagedModel",
    "TiedParameter",
    "balance_by_params",
    "balance_from_split_at",
    "call_stage",
    "check_balance",
    "find_tied",
    "from_stages",
    "measure_node_costs",
    "normalize_plan",
    "parameter_counts",
    "partition_min_max",
    "refuse_tied",
    "run_stages",
    "split_model",
    "trace_model",
    "unit_names",
    "unit_pieces",
]
