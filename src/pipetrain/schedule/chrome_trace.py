"""Chrome / Perfetto trace files of timelines (open in chrome://tracing or ui.perfetto.dev).

One process per timeline, one thread per rank, one complete ("X") event per action; times are
taken as seconds and written in microseconds. Simulated and measured timelines use this one format.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipetrain.schedule.ir import Kind, format_action
from pipetrain.schedule.timeline import Timeline

__all__ = ["trace_events", "write_trace"]

_CATEGORY = {Kind.F: "compute", Kind.B: "compute", Kind.I: "compute", Kind.W: "compute", Kind.FB: "compute",
             Kind.STEP: "update", Kind.SYNC: "sync"}


def trace_events(timeline: Timeline, *, pid: int = 0, name: str | None = None, scale: float = 1e6) -> list[dict[str, Any]]:
    """Trace events of one timeline; ``scale`` converts its time unit to microseconds."""
    schedule = timeline.schedule
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name or schedule.name}},
    ]
    for rank in range(schedule.num_ranks):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        for action, start, end in timeline.spans(rank):
            args: dict[str, Any] = {"stage": action.stage}
            if action.microbatch is not None:
                args["microbatch"] = action.microbatch
            if action.version is not None:
                args["version"] = action.version
            if action.kind is Kind.FB:  # a pair: its forward above, its backward here
                backward = action.peer
                args["backward"] = {"kind": backward.kind.value, "stage": backward.stage,
                                    "microbatch": backward.microbatch}
                if backward.version is not None:
                    args["backward"]["version"] = backward.version
            elif action.peer is not None:
                args["peer"] = action.peer
            events.append({
                "ph": "X", "name": format_action(action), "cat": _CATEGORY.get(action.kind, "comm"),
                "pid": pid, "tid": rank, "ts": start * scale, "dur": (end - start) * scale, "args": args,
            })
    return events


def write_trace(path: str, *timelines: Timeline, names: list[str] | None = None, scale: float = 1e6) -> None:
    """Write one or more timelines (e.g. measured and simulated) to a trace JSON file."""
    events: list[dict[str, Any]] = []
    for pid, timeline in enumerate(timelines):
        events.extend(trace_events(timeline, pid=pid, name=names[pid] if names else None, scale=scale))
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
    os.replace(tmp, path)
