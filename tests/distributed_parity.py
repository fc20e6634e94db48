"""Shared by the runtime parity tests: train configurations on the runtime, then on the emulator,
and require bitwise equal parameters."""

from __future__ import annotations

import dataclasses

import torch

from pipetrain.runtime.launch import launch
from pipetrain.training.distributed import worker
from pipetrain.training.train import train


def run_all(configs):
    """Worker entry: run several configurations in one process group (saves each model)."""
    for config in configs:
        worker(config)


def assert_distributed_equals_emulated(configs, workers: int, timeout: float) -> None:
    """``configs`` (distributed, each with ``save`` ending in "distributed.pt") run in ``workers``
    processes, then each again with the emulator: every parameter must be bitwise equal."""
    result = launch(run_all, (configs,), nprocs=workers, timeout=timeout, quiet=True)
    assert result.returncode == 0, result.message
    for config in configs:
        emulated = dataclasses.replace(config, executor="emulate", save=config.save.replace("distributed", "emulated"))
        train(emulated)
        a, b = torch.load(config.save), torch.load(emulated.save)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (config.model, config.schedule, key)
