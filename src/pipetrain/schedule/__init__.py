"""Schedules: the IR every executor shares, the named generators, validation and simulation."""

from pipetrain.schedule.check import check, problems
from pipetrain.schedule.costs import Costs, load_costs, parse_costs
from pipetrain.schedule.ir import Action, Kind, Schedule, dump, dumps, format_action, load, loads, parse_action
from pipetrain.schedule.lower import add_communication, strip_communication
from pipetrain.schedule.memory import memory_by_rank
from pipetrain.schedule.pb import pb_delays
from pipetrain.schedule.presets import ASYNCHRONOUS, SCHEDULES, build, order, resolve_name
from pipetrain.schedule.stream import warmup_depths
from pipetrain.schedule.timeline import Timeline, dry_run, simulate
from pipetrain.schedule.versions import POLICIES, assign_versions, staleness, units_per_update

__all__ = [
    "Action", "Kind", "Schedule", "format_action", "parse_action", "dump", "dumps", "load", "loads",
    "SCHEDULES", "ASYNCHRONOUS", "POLICIES", "build", "order", "resolve_name", "assign_versions",
    "add_communication", "strip_communication", "warmup_depths", "pb_delays",
    "check", "problems", "dry_run", "Costs", "parse_costs", "load_costs", "simulate", "Timeline",
    "memory_by_rank", "staleness", "units_per_update",
]
