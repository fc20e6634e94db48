"""Worker of the torch-runtime test: torch's own ``_PipelineScheduleRuntime`` runs schedules that
pipetrain wrote in torch's CSV format, over gloo, on the stages pipetrain cuts from the same model
and on the same batches (importable by the launcher's workers)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pipetrain.runtime.launch import init_distributed
from pipetrain.schedule import torch_csv
from pipetrain.training.distributed import worker
from pipetrain.training.setup import prepare


def run_pipetrain(configs) -> None:
    """pipetrain's runtime: each configuration trains and saves its model (rank 0)."""
    for config in configs:
        worker(config)


def run_torch(cases, lr: float) -> None:
    """torch's runtime: for each ``(config, csv_path, out_path)`` the model and batches
    ``config`` builds, trained by the schedule in ``csv_path`` with plain SGD at ``lr``; each rank
    saves its stages' parameters under the model's keys to ``out_path.RANK``."""
    init_distributed("gloo")
    rank = dist.get_rank()
    for config, csv_path, out_path in cases:
        run = prepare(dataclasses.replace(config, executor="emulate", save=None))
        placement = torch_csv.load(csv_path).stage_ranks
        held = [stage for stage, ranks in enumerate(placement) if ranks[0] == rank]
        modules = [run.staged.stages[stage] for stage in held]
        stages = [PipelineStage(module, stage, len(placement), torch.device("cpu"))
                  for stage, module in zip(held, modules)]
        runtime = _PipelineScheduleRuntime(stages, config.microbatches, loss_fn=run.loss_fn)
        runtime._load_csv(csv_path)
        optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=lr, foreach=False)
        data = run.unit_data()
        for update in range(run.updates):
            inputs, targets = data.batch(update)
            optimizer.zero_grad()
            runtime.step(inputs, target=targets)
            optimizer.step()
        data.close()
        state = {run.staged.key_map[stage][key]: value.detach().clone()
                 for stage, module in zip(held, modules) for key, value in module.state_dict().items()}
        torch.save(state, f"{out_path}.{rank}")
        dist.barrier()
