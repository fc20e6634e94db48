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

from pipetrain.errors import ConfigError, option
from pipetrain.optim.compensation import (parse_compensation, parse_dlr_delay, parse_dts_delay, parse_dtsf_delay,
                                          parse_dtt_delay, refuse_other_than_sgd, time_scaled_settings)
from pipetrain.optim.lr_schedule import parse_lr_schedule
from pipetrain.optim.spec import parse_optimizer_spec
from pipetrain.paths import IMAGE, JSON, WEIGHTS_INDEX, WEIGHTS_SINGLE, check_outputs, check_save, is_weights_dir
from pipetrain.plan.choose import is_auto, parse_auto
from pipetrain.schedule import POLICIES, resolve_name
from pipetrain.schedule.recompute_stages import parse_recompute
from pipetrain.spec import parse_spec
from pipetrain.training.config import CALIBRATION, TrainConfig
from pipetrain.training.options import declared, declared_check, one_of

__all__ = ["check_config", "check_execution", "check_optimizer_specs", "read_plan", "DEVICES", "BALANCE_BY", "MODEL_NAMES", "DATA_NAMES", "EXECUTORS", "NONFINITE", "RECOMPUTE",
           "PRECISIONS"]

#: Built-in names of ``--model`` and ``--data`` (``pipetrain.models.MODELS`` and
#: ``pipetrain.data.DATASETS``, which import PyTorch; a test keeps them equal).
MODEL_NAMES = ("gpt", "mlp", "resmlp", "resnet-gn", "resnet-gn-skip")
DATA_NAMES = ("digits", "synthetic", "text")
EXECUTORS = ("distributed", "emulate")
#: ``pipetrain.execution.nonfinite.NONFINITE`` (a test keeps them equal)
NONFINITE = ("stop", "skip", "off")
#: ``pipetrain.training.cutting.BALANCE_BY`` (a test keeps them equal)
BALANCE_BY = ("auto", "time", "params")
#: ``--recompute``: keep every activation (none), or only each stage's inputs (stage; ``stage:0,2``
#: for those stages): ``pipetrain.schedule.recompute_stages.RECOMPUTE`` (a test keeps them equal)
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
    _check_options(config)
    _check_choices(config)
    _check_counts(config)
    if specs:
        _check_specs(config)
    _check_plan(config)
    _check_checkpoints(config)
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    _check_init(config)
    if config.save:
        check_save(config.save, option("save"))
    sharded = bool(config.save) and is_weights_dir(config.save)  # every rank writes a shard of a directory
    files = {option("save"): None if sharded else config.save, option("report_json"): config.report_json,
             option("trace"): config.trace, option("plot"): config.plot,
             option("costs_file"): (config.costs_file or CALIBRATION) if config.calibrate else None}
    check_outputs(
        files=files if rank == 0 else {},
        directories={option("checkpoint_dir"): config.checkpoint_dir, option("save"): config.save if sharded else None},
        formats={option("report_json"): JSON, option("trace"): JSON, option("plot"): IMAGE, option("costs_file"): JSON},
    )


def _check_options(config: TrainConfig) -> None:
    """Each option's own check (declared with it), on the values that are given."""
    for field, declaration in declared(TrainConfig):
        value = getattr(config, field.name)
        if field.name == "costs_file" and config.calibrate:
            continue  # the calibration's output, checked as one below
        if declaration.check is not None and value is not None:
            declaration.check(field.name, value)


def _check_choices(config: TrainConfig) -> None:
    check_execution(config)
    if config.schedule is not None:
        parse_auto(config.schedule) if is_auto(config.schedule) else resolve_name(config.schedule)
    if config.policy is not None:
        one_of(*POLICIES)("policy", config.policy)


def check_execution(config: TrainConfig) -> None:
    """``--recompute``, ``--device`` and ``--precision`` (also checked by the set-up, for the Python API)."""
    if config.recompute is not None:  # the stage numbers are checked once the schedule is known

        parse_recompute(config.recompute)
    for name in ("device", "precision"):
        declared_check(TrainConfig, name)(name, getattr(config, name))
    if config.precision == "fp16":
        loss_scale_of(config)
    if config.precision != "fp32" and config.dtype == "float64":
        raise ConfigError(f"{option('precision', config.precision)} keeps float32 master weights: drop "
                          f"{option('dtype', 'float64')}")


def loss_scale_of(config: TrainConfig):
    """``--precision fp16``'s :class:`~pipetrain.execution.scaling.LossScale` (``None`` otherwise),
    from ``--loss-scale``, ``--loss-scale-init`` and ``--loss-scale-growth``."""
    if config.precision != "fp16":
        return None
    # imported here: it imports PyTorch, which check_config runs without (the set-up calls this)
    from pipetrain.execution.scaling import LossScale, check_power_of_two

    text = str(config.loss_scale).strip()
    if text == "dynamic":
        check_power_of_two(option("loss_scale_init"), config.loss_scale_init)
        growth = config.loss_scale_growth
        if not isinstance(growth, int) or isinstance(growth, bool) or growth < 1:
            raise ConfigError(f"{option('loss_scale_growth')} must be a whole number of updates >= 1, not {growth!r}")
        return LossScale(float(config.loss_scale_init), growth, dynamic=True)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{option('loss_scale')} must be 'dynamic' or a power of two such as 1024, "
                          f"not {text!r}") from None
    check_power_of_two(option("loss_scale"), value)
    return LossScale(value, 1, dynamic=False)


def _check_counts(config: TrainConfig) -> None:
    """What no option's own check sees: options that exclude one another."""
    if config.steps is not None and config.epochs is not None:
        raise ConfigError(f"give either {option('steps')} or {option('epochs')}, not both")
    if config.holdout is not None and config.test_data:
        raise ConfigError(f"give either {option('test_data')} or {option('holdout')}, not both")


def _check_specs(config: TrainConfig) -> None:
    parse_spec(config.model, builtins=MODEL_NAMES, kind="model")
    parse_spec(config.data, builtins=DATA_NAMES, kind="data set")
    if config.test_data:
        parse_spec(config.test_data, builtins=DATA_NAMES, kind="data set")
    check_optimizer_specs(config.optimizer, config.compensation, config.lr_schedule)


def check_optimizer_specs(optimizer_spec: str, compensation: str | None, lr_schedule: str | None) -> None:
    """``--optimizer``, ``--compensation`` and ``--lr-schedule`` as spec strings, and what each
    compensation needs of the optimizer (also checked by ``Pipeline(...)`` for its spec strings)."""
    optimizer = parse_optimizer_spec(optimizer_spec)
    methods = parse_compensation(compensation)
    parse_dlr_delay(compensation)  # dlr0: a reference delay that is not > 0
    parse_dts_delay(compensation)
    parse_dtsf_delay(compensation)
    parse_dtt_delay(compensation)
    if "sc" in methods and optimizer.name != "sgd":
        raise ConfigError(
            f"spike compensation is defined for momentum SGD only, not {optimizer.name!r}; use "
            f"{option('optimizer')} sgd:momentum=... with sc, or lwp alone with Adam (it predicts along the Adam step)"
        )
    for name in sorted(methods & {"dts", "dtsf", "dtt"}):
        refuse_other_than_sgd(name, optimizer.name)
    if methods & {"dts", "dtsf", "dtt"}:
        time_scaled_settings(float(optimizer.options.get("momentum", 0.0)), 0.0, 1.0)  # momentum 0: refused
    if lr_schedule:
        parse_lr_schedule(lr_schedule)


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
    given = [option(name) for name in ("stages", "balance", "split_at", "replicas") if getattr(config, name)]
    if given:
        raise ConfigError(f"the plan decides the stages and replicas: drop {', '.join(given)} or drop {option('plan')}")
    return plan, balance, replicas


def _check_plan(config: TrainConfig) -> None:
    if config.plan:
        read_plan(config)


def _check_init(config: TrainConfig) -> None:
    """``--init-from DIR`` names a weights directory (its index is read once PyTorch is there)."""
    if config.init is None or config.init.kind != "weights":
        return
    path = config.init.path
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return
    if not os.path.isdir(path):
        raise ConfigError(f"{option('init', path)}: no such directory; name a directory written by "
                          f"{option('save', 'DIR')} or save_pretrained")
    if not any(os.path.isfile(os.path.join(path, name)) for name in (WEIGHTS_INDEX, WEIGHTS_SINGLE)):
        raise ConfigError(f"{option('init', path)} holds neither {WEIGHTS_INDEX} nor {WEIGHTS_SINGLE}: it is not "
                          f"a weights directory (written by {option('save', 'DIR')} or save_pretrained)")


def _check_checkpoints(config: TrainConfig) -> None:
    if config.executor == "emulate" and (config.checkpoint_dir or config.resume or config.checkpoint_every):
        raise ConfigError(f"checkpoints are written by the distributed runtime: use {option('executor', 'distributed')}")
    if config.checkpoint_every and not config.checkpoint_dir:
        raise ConfigError(f"{option('checkpoint_every')} needs {option('checkpoint_dir', 'DIR')}")
    if config.resume is True and not config.checkpoint_dir:
        raise ConfigError(f"{option('resume')} needs {option('checkpoint_dir', 'DIR')} (or name a checkpoint: "
                          f"{option('resume', 'DIR/step-N')})")
    if config.extend and not (config.checkpoint_dir or config.resume):
        raise ConfigError(f"{option('extend')} continues the run of a checkpoint: give "
                          f"{option('checkpoint_dir', 'DIR')} (or {option('resume', 'DIR/step-N')})")
    if config.max_restarts and config.executor == "emulate":
        raise ConfigError(f"{option('max_restarts')} restarts the workers of the distributed runtime: use "
                          f"{option('executor', 'distributed')}")
