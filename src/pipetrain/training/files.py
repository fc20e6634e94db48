"""The files a finished run writes: ``--save``, ``--report-json``, ``--trace`` and ``--plot``, each
atomically, and a write that fails said in one line."""

from __future__ import annotations

import contextlib
from typing import Iterator

from pipetrain.errors import PipetrainError, option
from pipetrain.paths import is_weights_dir
from pipetrain.schedule.chrome_trace import write_trace
from pipetrain.training.config import TrainConfig
from pipetrain.training.outputs import save_state_dict, save_weights_here, weights_kept
from pipetrain.training.prediction import simulation_costs
from pipetrain.training.result import TrainResult
from pipetrain.training.timelines import plot_measured_and_simulated, simulated_counterpart

__all__ = ["write_outputs"]


def write_outputs(config: TrainConfig, result: TrainResult, run, state_dict=None) -> None:
    """--save, --report-json, --trace and --plot, each written atomically. ``state_dict``: the
    trained unsplit model's, for a one-file ``--save`` (default: ``run.model``'s); a weights
    directory is written here only when every stage lives in this process (the emulator: the
    runtime's ranks write their own shards). One that cannot be written (a full disk) stops the
    run with one line naming it; for --save, the line says where the trained weights are kept
    instead, if anywhere."""
    if config.save:
        if not is_weights_dir(config.save):
            with _writing("save", config.save, _weights_kept(config, result)):
                save_state_dict(run.model.state_dict() if state_dict is None else state_dict, config.save)
        elif config.executor == "emulate":
            with _writing("save", config.save, _weights_kept(config, result)):
                save_weights_here(run, dict(enumerate(run.staged.stages)))
    if config.report_json:
        with _writing("report_json", config.report_json):
            result.write_report(config.report_json)
    costs = None
    if (config.trace or config.plot) and result.timeline is not None and config.costs_file:
        costs = simulation_costs(run, result.timeline, run.calibration)  # read once per run
    if config.trace and result.timeline is not None:

        with _writing("trace", config.trace):
            write_trace(config.trace, result.timeline, simulated_counterpart(result.timeline, costs),
                        names=[f"{result.schedule} measured", f"{result.schedule} simulated"])
    if config.plot and result.timeline is not None:
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
    return weights_kept(config, result.updates)
