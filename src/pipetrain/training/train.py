"""Train from a configuration on the chosen executor, then write the requested outputs.

The one path of every run: the command line calls :func:`train` with its configuration (parts
built from the specs), the Python API with the user's objects (:class:`~pipetrain.Pipeline`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

from pipetrain.errors import PipetrainError, option
from pipetrain.training.config import TrainConfig
from pipetrain.training.parts import RunParts
from pipetrain.training.result import TrainResult

__all__ = ["train", "write_outputs"]


def train(config: TrainConfig, parts: RunParts | None = None, callbacks: Any = None) -> TrainResult | None:
    """Run training; returns the result.

    On the emulator, and on every rank of the distributed runtime, the result of the run (rank 0's
    carries the measured timeline). A command-line launcher returns rank 0's result. With
    ``parts`` (the Python API) outside a distributed environment, the user's script is started
    once per worker (:func:`~pipetrain.runtime.launch.launch_script`) and the exit status of the
    workers is raised as :class:`SystemExit` here: the workers ran the script, this process only
    watched them.
    """
    from pipetrain.training.callbacks import Callbacks
    from pipetrain.training.setup import prepare
    from pipetrain.training.validate import check_config

    if config.calibrate:
        config = _calibrated(config, parts)
    check_config(config, specs=parts is None)  # options and output paths, before any work

    callbacks = callbacks if isinstance(callbacks, Callbacks) else Callbacks(callbacks or ())
    if config.executor == "emulate":  # check_config refused checkpoint options here
        import torch

        from pipetrain.training.emulated import train_emulated

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
    from pipetrain.runtime.launch import detect
    from pipetrain.training import distributed

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


#: where ``calibrate`` writes its costs file when no ``costs_file`` is named
CALIBRATION = "calibration.json"


def _calibrated(config: TrainConfig, parts: RunParts | None) -> TrainConfig:
    """``config`` with the costs file that ``calibrate`` asked for: measured here
    (:func:`pipetrain.training.calibration.calibrate`) after the other options passed their checks,
    unless this process is a worker of a started run (the process that started it measured)."""
    from dataclasses import replace

    from pipetrain.runtime.launch import detect
    from pipetrain.training.validate import check_config

    path = config.costs_file or CALIBRATION
    config = replace(config, costs_file=None, calibrate=False)
    if detect() is None:
        check_config(config, specs=parts is None)  # nothing measured for a run that would be refused
        from pipetrain.paths import JSON, check_outputs
        from pipetrain.training.calibration import calibrate
        from pipetrain.training.result import write_json_atomic

        check_outputs(files={option("costs_file"): path}, formats={option("costs_file"): JSON})
        if not config.quiet:
            print(f"calibrating this machine for the simulator (about 10 s; {option('costs_file', path)})")
        import torch

        cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        data, _ = calibrate("cuda" if cuda else "cpu")
        write_json_atomic(path, data)
    elif not os.path.exists(path):
        raise PipetrainError(f"{option('calibrate')} in a worker of a run started by torchrun: no {path} here to "
                             f"read; run `pipetrain calibrate --out {path}` before the run and pass "
                             f"{option('costs_file', path)} instead")
    return replace(config, costs_file=path)


def write_outputs(config: TrainConfig, result: TrainResult, run, state_dict=None) -> None:
    """--save, --report-json, --trace and --plot, each written atomically. ``state_dict``: the
    trained unsplit model's, for a one-file ``--save`` (default: ``run.model``'s); a weights
    directory is written here only when every stage lives in this process (the emulator: the
    runtime's ranks write their own shards). One that cannot be written (a full disk) stops the
    run with one line naming it; for --save, the line says where the trained weights are kept
    instead, if anywhere."""
    if config.save:
        from pipetrain.paths import is_weights_dir

        if not is_weights_dir(config.save):
            from pipetrain.training.outputs import save_state_dict

            with _writing("save", config.save, _weights_kept(config, result)):
                save_state_dict(run.model.state_dict() if state_dict is None else state_dict, config.save)
        elif config.executor == "emulate":
            from pipetrain.training.outputs import save_weights_here

            with _writing("save", config.save, _weights_kept(config, result)):
                save_weights_here(run, dict(enumerate(run.staged.stages)))
    if config.report_json:
        with _writing("report_json", config.report_json):
            result.write_report(config.report_json)
    costs = None
    if (config.trace or config.plot) and result.timeline is not None and config.costs_file:
        from pipetrain.training.prediction import load_calibration, simulation_costs

        with warnings.catch_warnings():  # the report's figures warned already
            warnings.simplefilter("ignore")
            costs = simulation_costs(run, result.timeline, load_calibration(config.costs_file))
    if config.trace and result.timeline is not None:
        from pipetrain.schedule.trace import write_trace
        from pipetrain.training.timelines import simulated_counterpart

        with _writing("trace", config.trace):
            write_trace(config.trace, result.timeline, simulated_counterpart(result.timeline, costs),
                        names=[f"{result.schedule} measured", f"{result.schedule} simulated"])
    if config.plot and result.timeline is not None:
        from pipetrain.training.timelines import plot_measured_and_simulated

        with _writing("plot", config.plot):
            plot_measured_and_simulated(result.timeline, config.plot, f"{result.schedule} ({result.executor})",
                                        units_per_update=result.extra.get("units_per_update", 1), costs=costs)


@contextlib.contextmanager
def _writing(field: str, path: str, then: str = "") -> Iterator[None]:
    """An output's ``OSError`` as one line: ``cannot write --save PATH: No space left on device``
    (``field``: the option that names the output)."""
    try:
        yield
    except OSError as error:
        raise PipetrainError(f"cannot write {option(field, path)}: {error.strerror or error}{then}") from None


def _weights_kept(config: TrainConfig, result: TrainResult) -> str:
    """Where the trained weights are when --save cannot be written: the run's last checkpoint."""
    from pipetrain.training.outputs import weights_kept

    return weights_kept(config, result.updates)
