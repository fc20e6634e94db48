"""How well a run was predicted: its time per update, measured, against the simulator's.

The simulator is fed what the run itself measured (each stage's median F, B, W and STEP times,
:func:`~pipetrain.training.timelines.measured_costs`), on the run's own schedule and cut; with a
calibration (``--costs-file``, written by ``pipetrain calibrate``) it also charges each message
its sender's and receiver's busy time and its time in flight (the stage's output bytes, sized on
the meta device), every action the interpreter's overhead, and a replicated stage's SYNC its
all-reduce of the stage's parameter bytes. Without one the figure is compute only and the report
says ``"calibrated": false``.

Both figures are steady-state times per update, read alike: the median gap between consecutive
ends of the last stage's updates, after the first fifth of the run (start-up excluded; the median
resists evaluations and other pauses).
"""

from __future__ import annotations

from typing import Any, Sequence

from pipetrain.schedule.costs import Costs, load_calibration
from pipetrain.schedule.timeline import Timeline, simulate
from pipetrain.training.shapes import stage_output_bytes
from pipetrain.training.timelines import measured_costs, seconds_per_update, update_ends

__all__ = ["calibrated_costs", "simulation_costs", "load_calibration", "prediction"]


def calibrated_costs(compute: Costs, calibration: Costs, message_bytes: Sequence[float] | None,
                     parameter_bytes: Sequence[float] | None) -> Costs:
    """``compute`` (per-stage F, B, W, STEP) with ``calibration``'s communication and overhead:
    messages of ``message_bytes`` per stage boundary, a SYNC of a stage's ``parameter_bytes``."""
    sync: Any = calibration.sync
    if parameter_bytes is not None and isinstance(calibration.sync, (int, float)):
        sync = [calibration.sync + calibration.sync_per_byte * p for p in parameter_bytes]
    costs = Costs(
        F=compute.F, B=compute.B, W=compute.W, full=compute.full, step=compute.step, sync=sync,
        bytes=list(message_bytes) if message_bytes is not None else 0.0, bandwidth=calibration.bandwidth,
        measured_on=calibration.measured_on,
    )
    return costs.charging(calibration)


def _parameter_bytes(run: Any) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)
            for stage in run.staged.stages]


def simulation_costs(run: Any, measured: Timeline, calibration: Costs | None = None) -> Costs:
    """The costs that simulate ``run``: its measured unit times, with ``calibration`` if given."""
    compute = measured_costs(measured)
    if calibration is None:
        return compute
    stages = run.staged.stages
    sizes = stage_output_bytes(run) if len(stages) == measured.schedule.num_stages else None
    params = _parameter_bytes(run) if len(stages) == measured.schedule.num_stages else None
    return calibrated_costs(compute, calibration, sizes, params)


def prediction(run: Any, measured: Timeline, ends: Sequence[float]) -> dict[str, Any]:
    """The report's figures: ``measured_seconds_per_update`` (from ``ends``, the run's
    ``update_seconds``), ``simulated_seconds_per_update`` (with the run's calibration, if any),
    ``simulated_compute_only_seconds_per_update``, ``calibrated``, ``measured_over_simulated``."""
    calibration = run.calibration
    compute_only = seconds_per_update(update_ends(simulate(measured.schedule, measured_costs(measured))))
    simulated = compute_only
    if calibration is not None:
        simulated = seconds_per_update(update_ends(simulate(measured.schedule,
                                                            simulation_costs(run, measured, calibration))))
    measured_figure = seconds_per_update(ends)
    out: dict[str, Any] = {
        "measured_seconds_per_update": measured_figure,
        "simulated_seconds_per_update": simulated,
        "simulated_compute_only_seconds_per_update": compute_only,
        "calibrated": calibration is not None,
        "measured_over_simulated": measured_figure / simulated if measured_figure and simulated else None,
    }
    if calibration is not None:
        out["calibration"] = {"file": run.config.costs_file, "measured_on": calibration.measured_on}
    return out

