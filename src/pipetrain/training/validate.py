"""Checks of a training configuration that need neither PyTorch nor the data: run at once.

`pipetrain train` builds its :class:`~pipetrain.training.config.TrainConfig` and calls
:func:`check_config` before it imports PyTorch (2-3 s here) or spawns a worker, so a misspelt
schedule, optimizer, model name or output path is reported within a fraction of a second, not
after the set-up, and never after the training. The set-up checks everything again, and what only
the model and the data can tell (a model option, the cut into stages, the shapes); those errors
come later.
"""

from __future__ import annotations

import json
import os

from pipetrain.errors import ConfigError
from pipetrain.paths import IMAGE, JSON, WEIGHTS_INDEX, WEIGHTS_SINGLE, check_outputs, is_weights_dir
from pipetrain.training.config import TrainConfig

__all__ = ["check_config", "check_execution", "read_plan", "DEVICES", "BALANCE_BY", "MODEL_NAMES", "DATA_NAMES", "EXECUTORS", "NONFINITE", "RECOMPUTE",
           "PRECISIONS"]

#: Built-in names of ``--model`` and ``--data`` (``pipetrain.models.MODELS`` and
#: ``pipetrain.data.DATASETS``, which import PyTorch; a test keeps them equal).
MODEL_NAMES = ("gpt", "mlp", "resmlp", "resnet-gn", "resnet-gn-skip")
DATA_NAMES = ("digits", "synthetic", "text")
EXECUTORS = ("distributed", "emulate")
#: ``pipetrain.execution.stage.NONFINITE`` (a test keeps them equal)
NONFINITE = ("stop", "skip", "off")
_DTYPES = ("float32", "float64")
_RECEIVES = ("auto", "on-demand", "ahead")
#: ``pipetrain.training.setup.BALANCE_BY`` (a test keeps them equal)
BALANCE_BY = ("auto", "time", "params")
#: ``--recompute``: keep every activation (none), or only each stage's inputs (stage; ``stage:0,2``
#: for those stages): ``pipetrain.schedule.recompute.RECOMPUTE`` (a test keeps them equal)
RECOMPUTE = ("none", "stage")
#: ``pipetrain.execution.device.DEVICES`` (a test keeps them equal)
DEVICES = ("auto", "cpu", "cuda")
#: ``--precision`` (fp16 with a loss scale, see :func:`loss_scale_of`)
PRECISIONS = ("fp32", "bf16", "fp16")


def check_config(config: TrainConfig, *, rank: int | None = None, specs: bool = True) -> None:
    """Raise a :class:`~pipetrain.errors.ConfigError` (or ``ScheduleError``) for the first problem
    of ``config`` found without PyTorch: choices, counts, specs, the plan file, checkpoint options
    and output paths. ``rank``: under a launcher such as torchrun, this process's rank (only rank 0
    writes ``--save``, ``--report-json``, ``--trace`` and ``--plot``; every rank writes
    checkpoints); default: from the environment's ``RANK``, else 0. ``specs=False``: the model,
    data and optimizer are live objects (the Python API), and their fields only describe them."""
    _check_choices(config)
    _check_counts(config)
    if specs:
        _check_specs(config)
    _check_plan(config)
    _check_checkpoints(config)
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    _check_init(config)
    sharded = bool(config.save) and is_weights_dir(config.save)  # every rank writes a shard of a directory
    files = {"--save": None if sharded else config.save, "--report-json": config.report_json, "--trace": config.trace,
             "--plot": config.plot}
    check_outputs(
        files=files if rank == 0 else {},
        directories={"--checkpoint-dir": config.checkpoint_dir, "--save": config.save if sharded else None},
        formats={"--report-json": JSON, "--trace": JSON, "--plot": IMAGE},
    )


def _choice(option: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")


def _check_choices(config: TrainConfig) -> None:
    from pipetrain.schedule import POLICIES, resolve_name

    _choice("--executor", config.executor, EXECUTORS)
    if config.dtype is not None:  # None (the Python API): the model's own dtype
        _choice("--dtype", config.dtype, _DTYPES)
    _choice("--receives", config.receives, _RECEIVES)
    _choice("--on-nonfinite", config.on_nonfinite, NONFINITE)
    _choice("--balance-by", config.balance_by, BALANCE_BY)
    check_execution(config)
    if config.schedule is not None:
        resolve_name(config.schedule)
    if config.policy is not None:
        _choice("--policy", config.policy, POLICIES)


def check_execution(config: TrainConfig) -> None:
    """``--recompute`` and ``--precision`` (also checked by the set-up, for the Python API)."""
    if config.recompute is not None:  # the stage numbers are checked once the schedule is known
        from pipetrain.schedule.recompute import parse_recompute

        parse_recompute(config.recompute)
    _choice("--device", config.device, DEVICES)
    _choice("--precision", config.precision, PRECISIONS)
    if config.precision == "fp16":
        loss_scale_of(config)
    if config.precision != "fp32" and config.dtype == "float64":
        raise ConfigError(f"--precision {config.precision} keeps float32 master weights: drop --dtype float64")


def loss_scale_of(config: TrainConfig):
    """``--precision fp16``'s :class:`~pipetrain.execution.scaling.LossScale` (``None`` otherwise),
    from ``--loss-scale``, ``--loss-scale-init`` and ``--loss-scale-growth``."""
    if config.precision != "fp16":
        return None
    from pipetrain.execution.scaling import LossScale, check_power_of_two

    text = str(config.loss_scale).strip()
    if text == "dynamic":
        check_power_of_two("--loss-scale-init", config.loss_scale_init)
        growth = config.loss_scale_growth
        if not isinstance(growth, int) or isinstance(growth, bool) or growth < 1:
            raise ConfigError(f"--loss-scale-growth must be a whole number of updates >= 1, not {growth!r}")
        return LossScale(float(config.loss_scale_init), growth, dynamic=True)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--loss-scale must be 'dynamic' or a power of two such as 1024, not {text!r}") from None
    check_power_of_two("--loss-scale", value)
    return LossScale(value, 1, dynamic=False)


def _at_least(option: str, value: float | None, low: float, strict: bool = False) -> None:
    if value is None:
        return
    if value < low or (strict and value == low):
        raise ConfigError(f"{option} must be {'greater than' if strict else 'at least'} {low:g}, got {value:g}")


def _check_counts(config: TrainConfig) -> None:
    for option, value in (("--batch-size", config.batch_size), ("--steps", config.steps),
                          ("--microbatches", config.microbatches), ("--chunks", config.chunks),
                          ("--stages", config.stages), ("--workers", config.workers),
                          ("--threads-per-worker", config.threads_per_worker), ("--keep", config.keep)):
        _at_least(option, value, 1)
    for option, value in (("--eval-every", config.eval_every), ("--eval-samples", config.eval_samples),
                          ("--checkpoint-every", config.checkpoint_every), ("--max-restarts", config.max_restarts)):
        _at_least(option, value, 0)
    _at_least("--epochs", config.epochs, 0, strict=True)
    _at_least("--timeout", config.timeout, 0, strict=True)
    for option, values in (("--balance", config.balance), ("--replicas", config.replicas)):
        if values is not None and any(v < 1 for v in values):
            raise ConfigError(f"{option} {','.join(map(str, values))}: every entry must be at least 1")
    if config.steps is not None and config.epochs is not None:
        raise ConfigError("give either --steps or --epochs, not both")
    workers = config.data_workers
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
        raise ConfigError(f"--data-workers must be an integer >= 0 (0 reads on the training thread), got {workers!r}")
    if config.holdout is not None:
        if not (isinstance(config.holdout, (int, float)) and 0 < config.holdout < 1):
            raise ConfigError(f"--holdout must be a fraction between 0 and 1 (e.g. 0.2), got {config.holdout!r}")
        if config.test_data:
            raise ConfigError("give either --test-data or --holdout, not both")


def _check_specs(config: TrainConfig) -> None:
    from pipetrain.optim.compensation import (parse_compensation, parse_dlr_delay, parse_dts_delay, parse_dtsf_delay,
                                              parse_dtt_delay, refuse_other_than_sgd)
    from pipetrain.optim.lr_schedule import parse_lr_schedule
    from pipetrain.optim.spec import parse_optimizer_spec
    from pipetrain.spec import parse_spec

    parse_spec(config.model, builtins=MODEL_NAMES, kind="model")
    parse_spec(config.data, builtins=DATA_NAMES, kind="data set")
    if config.test_data:
        parse_spec(config.test_data, builtins=DATA_NAMES, kind="data set")
    optimizer = parse_optimizer_spec(config.optimizer)
    methods = parse_compensation(config.compensation)
    parse_dlr_delay(config.compensation)  # dlr0: a reference delay that is not > 0
    parse_dts_delay(config.compensation)
    parse_dtsf_delay(config.compensation)
    parse_dtt_delay(config.compensation)
    if "sc" in methods and optimizer.name != "sgd":
        raise ConfigError(
            f"spike compensation is defined for momentum SGD only, not {optimizer.name!r}; use "
            "--optimizer sgd:momentum=... with sc, or lwp alone with Adam (it predicts along the Adam step)"
        )
    for name in sorted(methods & {"dts", "dtsf", "dtt"}):
        refuse_other_than_sgd(name, optimizer.name)
    if methods & {"dts", "dtsf", "dtt"}:
        from pipetrain.optim.compensation import time_scaled_settings

        time_scaled_settings(float(optimizer.options.get("momentum", 0.0)), 0.0, 1.0)  # momentum 0: refused
    if config.lr_schedule:
        parse_lr_schedule(config.lr_schedule)


def read_plan(config: TrainConfig) -> tuple[dict, list[int], list[int]]:
    """``(plan, balance, replicas)`` of ``config.plan`` (a `pipetrain plan --out` JSON file), or
    one ConfigError saying what is wrong with it, or that other options also set the stages."""
    try:
        with open(config.plan, encoding="utf-8") as handle:
            plan = json.load(handle)
        balance, replicas = [int(n) for n in plan["balance"]], [int(r) for r in plan["replicas"]]
        flags = [stage.get("recompute", False) for stage in plan.get("stages", [])]
        if any(not isinstance(flag, bool) for flag in flags):
            raise ValueError(f"a stage's recompute must be true or false, not {flags}")
    except OSError as error:
        raise ConfigError(f"cannot read plan {config.plan!r}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"{config.plan!r} is not a plan written by `pipetrain plan --out` ({type(error).__name__}: {error})"
        ) from None
    given = [flag for flag, value in (("--stages", config.stages), ("--balance", config.balance),
                                      ("--split-at", config.split_at), ("--replicas", config.replicas)) if value]
    if given:
        raise ConfigError(f"the plan decides the stages and replicas: drop {', '.join(given)} or drop --plan")
    return plan, balance, replicas


def _check_plan(config: TrainConfig) -> None:
    if config.plan:
        read_plan(config)


def _check_init(config: TrainConfig) -> None:
    """``--init-from DIR`` names a weights directory (its index is read once PyTorch is there)."""
    path = config.init
    if not path or path == "reset" or path.startswith("function "):
        return
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return
    if not os.path.isdir(path):
        raise ConfigError(f"--init-from {path!r}: no such directory; name a directory written by --save DIR or "
                          f"save_pretrained")
    if not any(os.path.isfile(os.path.join(path, name)) for name in (WEIGHTS_INDEX, WEIGHTS_SINGLE)):
        raise ConfigError(f"--init-from {path!r} holds neither {WEIGHTS_INDEX} nor {WEIGHTS_SINGLE}: it is not a "
                          f"weights directory "
                          f"(written by --save DIR or save_pretrained)")


def _check_checkpoints(config: TrainConfig) -> None:
    if config.executor == "emulate" and (config.checkpoint_dir or config.resume or config.checkpoint_every):
        raise ConfigError("checkpoints are written by the distributed runtime: use --executor distributed")
    if config.checkpoint_every and not config.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR")
    if config.resume is True and not config.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir DIR (or name a checkpoint: --resume DIR/step-N)")
    if config.extend and not (config.checkpoint_dir or config.resume):
        raise ConfigError("--extend continues the run of a checkpoint: give --checkpoint-dir DIR (or --resume DIR/step-N)")
    if config.max_restarts and config.executor == "emulate":
        raise ConfigError("--max-restarts restarts the workers of the distributed runtime: use --executor distributed")
