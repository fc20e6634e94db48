"""Train from a configuration on the chosen executor, then write the requested outputs.

The one path of every run: the command line calls :func:`train` with its configuration (parts
built from the specs), the Python API with the user's objects (:class:`~pipetrain.Pipeline`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from pipetrain.errors import PipetrainError, option
from pipetrain.execution.device import resolve_device
from pipetrain.runtime.launch import detect
from pipetrain.training import distributed
from pipetrain.training.calibration import calibrate
from pipetrain.training.callbacks import Callbacks
from pipetrain.training.config import CALIBRATION, TrainConfig
from pipetrain.training.emulated import train_emulated
from pipetrain.training.files import write_outputs
from pipetrain.training.parts import RunParts
from pipetrain.training.result import TrainResult, write_json_atomic
from pipetrain.training.setup import prepare
from pipetrain.training.validate import check_config

__all__ = ["train"]


def train(config: TrainConfig, parts: RunParts | None = None, callbacks: Any = None) -> TrainResult | None:
    """Run training; returns the result.

    On the emulator, and on every rank of the distributed runtime, the result of the run (rank 0's
    carries the measured timeline). A command-line launcher returns rank 0's result. With
    ``parts`` (the Python API) outside a distributed environment, the user's script is started
    once per worker (:func:`~pipetrain.runtime.launch.launch_script`) and the exit status of the
    workers is raised as :class:`SystemExit` here: the workers ran the script, this process only
    watched them.
    """
    check_config(config, specs=parts is None)  # options and output paths, before any work
    if config.calibrate:  # measured only for a run that passed its checks
        config = _calibrated(config)

    callbacks = callbacks if isinstance(callbacks, Callbacks) else Callbacks(callbacks or ())
    if config.executor == "emulate":  # check_config refused checkpoint options here

        # the same thread count as a runtime worker: matrix kernels then round the same way,
        # and the emulator's parameters equal the runtime's bitwise; the caller's count comes back after
        threads = torch.get_num_threads()
        torch.set_num_threads(config.threads_per_worker)
        try:
            run = prepare(config, parts)
            result = train_emulated(run, callbacks or None)
            write_outputs(config, result, run)
        finally:
            torch.set_num_threads(threads)
        callbacks.end(result)
        return result

    if parts is None:
        result = distributed.train_distributed(config)
        if result is not None:
            callbacks.end(result)
        return result
    if detect() is None:
        distributed.spawn_script(prepare(config, parts))  # raises SystemExit with the workers' status
    distributed.refuse_restarts_here(config)
    env = distributed.join(config)
    result = distributed.run_worker(prepare(config, parts), env, callbacks or None)
    callbacks.end(result)
    return result


def _calibrated(config: TrainConfig) -> TrainConfig:
    """``config`` with the costs file that ``calibrate`` asked for: measured here
    (:func:`pipetrain.training.calibration.calibrate`), unless this process is a worker of a
    started run (the process that started it measured)."""
    path = config.costs_file or CALIBRATION
    if detect() is None:
        if not config.quiet:
            print(f"calibrating this machine for the simulator (about 10 s), into {path}")
        data, _ = calibrate(resolve_device(config.device).type)
        write_json_atomic(path, data)
    elif not os.path.exists(path):
        raise PipetrainError(f"{option('calibrate')} in a worker of a run started by torchrun: no {path} here to "
                             f"read; run `pipetrain calibrate --out {path}` before the run and pass "
                             f"{option('costs_file', path)} instead")
    return replace(config, costs_file=path, calibrate=False)
