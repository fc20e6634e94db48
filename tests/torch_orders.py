"""Shared by the tests of the schedules torch also has: the compute order torch builds, on
stand-in stage objects (no process group: torch's schedule classes read only a stage's index,
its pipeline's size and rank, and its module)."""

from __future__ import annotations

import re

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from pipetrain.schedule.ir import Kind

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class StandInStage:
    """What torch's multi-stage schedule classes read of a stage while building their order."""

    def __init__(self, index: int, stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
        self.submod = None
        self.is_first, self.is_last = index == 0, index == stages - 1


def torch_schedule(cls_name: str, ranks: int, chunks: int, microbatches: int):
    """torch's schedule object of class ``cls_name`` (as rank 0 builds it: every rank's order)."""
    style = "v" if cls_name in V_SHAPED else "loop"
    held = generate_rank_to_stage_mapping(ranks, ranks * chunks, style=style)[0]
    stages = [StandInStage(index, ranks * chunks, ranks) for index in held]
    return getattr(schedules, cls_name)(stages, microbatches, loss_fn=lambda output, target: output)


def torch_order(cls_name: str, ranks: int, chunks: int, microbatches: int) -> list[list[str]]:
    """Each rank's actions in torch's order, idle steps left out, pairs as pipetrain writes them."""
    order = torch_schedule(cls_name, ranks, chunks, microbatches).pipeline_order
    return [[str(a).replace("OVERLAP_F_B", "") for a in order[rank] if a is not None] for rank in range(ranks)]


def compute_order(schedule) -> list[list[str]]:
    """A pipetrain schedule's compute actions per rank (no updates, no versions), as torch writes them."""
    return [[re.sub(r"@v\d+", "", str(a)) for a in program if a.kind is not Kind.STEP] for program in schedule.programs]
