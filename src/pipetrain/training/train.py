"""Train from a configuration on the chosen executor, then write the requested outputs."""

from __future__ import annotations

from pipetrain.training.config import TrainConfig
from pipetrain.training.result import TrainResult, write_json_atomic

__all__ = ["train", "write_outputs"]


def train(config: TrainConfig) -> TrainResult | None:
    """Run training; returns the result (``None`` on distributed ranks other than 0)."""
    from pipetrain.training.validate import check_config

    check_config(config)  # options and output paths, before any work
    if config.executor == "emulate":
        if config.checkpoint_dir or config.resume or config.checkpoint_every:
            from pipetrain.errors import ConfigError

            raise ConfigError("checkpoints are written by the distributed runtime: use --executor distributed")
        import torch

        from pipetrain.emulate.train import train_emulated
        from pipetrain.training.setup import prepare

        # the same thread count as a runtime worker: matrix kernels then round the same way,
        # and the emulator's parameters equal the runtime's bitwise
        torch.set_num_threads(config.threads_per_worker)
        run = prepare(config)
        result = train_emulated(run)
        write_outputs(config, result, run.model.state_dict())
        return result
    from pipetrain.runtime.train import train_distributed

    return train_distributed(config)


def write_outputs(config: TrainConfig, result: TrainResult, state_dict) -> None:
    """--save, --report-json, --trace and --plot, each written atomically."""
    if config.save:
        from pipetrain.training.outputs import save_state_dict

        save_state_dict(state_dict, config.save)
    if config.report_json:
        write_json_atomic(config.report_json, result.report())
    if config.trace and result.timeline is not None:
        from pipetrain.schedule.trace import write_trace
        from pipetrain.training.timelines import simulated_counterpart

        write_trace(config.trace, result.timeline, simulated_counterpart(result.timeline),
                    names=[f"{result.schedule} measured", f"{result.schedule} simulated"])
    if config.plot and result.timeline is not None:
        from pipetrain.training.timelines import plot_measured_and_simulated

        plot_measured_and_simulated(result.timeline, config.plot, f"{result.schedule} ({result.executor})",
                                    units_per_update=result.extra.get("units_per_update", 1))
