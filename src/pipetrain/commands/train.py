"""`pipetrain train`: train a model with any schedule, on the emulator or the distributed runtime."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run", "config_from_args", "speed"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every option declared in :class:`~pipetrain.training.config.TrainConfig`, by group."""
    from pipetrain.training.config import TrainConfig
    from pipetrain.training.options import GROUPS, declared, flag_name

    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for field, declaration in declared(TrainConfig):
        for flag in declaration.flags:
            details = {"default": field.default if flag is declaration.flags[0] else None, **flag.details}
            if details.get("action") in ("store_true", "store_false"):
                details.pop("default")
            groups[declaration.group].add_argument(flag_name(field, flag), help=flag.help, **details)


def config_from_args(args: argparse.Namespace):
    """The :class:`~pipetrain.training.config.TrainConfig` of parsed flags: each option's own
    ``from_cli``, else its flag's value."""
    from pipetrain.training.config import TrainConfig
    from pipetrain.training.options import declared, flag_name

    values = {}
    for field, declaration in declared(TrainConfig):
        if declaration.from_cli is not None:
            values[field.name] = declaration.from_cli(args)
        elif declaration.flags:
            values[field.name] = getattr(args, flag_name(field, declaration.flags[0])[2:].replace("-", "_"))
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    from pipetrain.training.validate import check_config

    config = config_from_args(args)
    check_config(config)  # choices, specs, plan and output paths, before PyTorch is imported
    from pipetrain.collector import loading

    with loading():  # PyTorch and the training modules, without the collections that find nothing in them
        from pipetrain.training.outputs import metrics_text
        from pipetrain.training.train import train

    result = train(config)
    if result is None or not result.is_main:  # a worker process of the distributed runtime: rank 0 reports
        _finish_if_worker()
        return 0
    line = (
        f"{result.schedule}: {result.updates} steps on {result.workers} "
        f"{'workers' if result.executor == 'distributed' else 'emulated ranks'}, "
        f"{speed(result)}, final loss {result.final_loss:.4f}"
    )
    if result.evaluations:
        line += ", " + metrics_text(result.evaluations[-1])
    print(line)
    scale = result.extra.get("loss_scale")
    if scale is not None:
        skips = scale["per_stage"][0]["skipped"] if scale["per_stage"] else []
        print(f"fp16 loss scale: {scale['final']:g} at the end; updates skipped on overflow: "
              + (_ranges(skips) if skips else "none")
              + ("" if scale["stages_agree"] else " on stage 0 (" + "; ".join(
                  f"stage {s}: {_ranges(p['skipped']) if p['skipped'] else 'none'}" for s, p in enumerate(scale["per_stage"])) + ")"))
    skipped = result.extra.get("skipped_updates") or []
    if any(skipped):
        print("skipped updates whose gradient was not finite (--on-nonfinite skip): "
              + "; ".join(f"stage {stage}: {_ranges(steps)}" for stage, steps in enumerate(skipped) if steps))
    for flag, path in (("model", config.save), ("report", config.report_json), ("trace", config.trace),
                       ("plot", config.plot)):
        if path:
            print(f"wrote {flag}: {path}")
    _finish_if_worker()
    return 0


def speed(result) -> str:
    """The run's speed in words that say something at any size: whole samples a second from 10
    on, two significant digits below, and under one sample a second (a large model on a small
    machine) the seconds each update took besides."""
    rate = result.samples_per_s
    if rate >= 10:
        return f"{rate:.0f} samples/s"
    text = f"{rate:.2g} samples/s"
    if rate < 1 and result.updates:
        text += f" ({result.seconds / result.updates:.3g} s per update)"
    return text


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"steps 3-5, 9"``."""
    parts: list[list[int]] = []
    for step in steps:
        if parts and step == parts[-1][1] + 1:
            parts[-1][1] = step
        else:
            parts.append([step, step])
    return "step" + ("s " if len(steps) > 1 else " ") + ", ".join(
        str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _finish_if_worker() -> None:
    """A worker started by torchrun leaves the process group and exits here (see
    :func:`pipetrain.runtime.launch.finish_worker`)."""
    if config_is_worker():
        from pipetrain.runtime.launch import finish_worker

        finish_worker()


def config_is_worker() -> bool:
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ
