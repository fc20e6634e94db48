"""The options of a training run, each declared once: its type and default, and in its metadata
its flag and help on `pipetrain train`, its check, whether a checkpoint must agree on it, and
where it is a Python keyword (see :mod:`pipetrain.training.options`)."""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from pipetrain.errors import ConfigError, PipetrainError, name_options
from pipetrain.errors import option as option_name
from pipetrain.initialiser import Init, init_from_flags, resolve_init
from pipetrain.optim import parse_optimizer_spec, translate_hyperparameters
from pipetrain.schedule.costs import load_costs
from pipetrain.training.options import (Flag, at_least, declared, entries_at_least, flag_of, int_list, key_values,
                                        keyword_of, name_list, one_of, option, whole_number)

__all__ = ["TrainConfig", "CALIBRATION"]

#: where ``calibrate`` writes its costs file when no ``costs_file`` is named
CALIBRATION = "calibration.json"


def _init(args: argparse.Namespace) -> Init | None:
    return init_from_flags(args.init, args.init_from)


def _calibration(field: str, path: str) -> None:
    """A costs file that cannot be read, or is malformed, is refused before the run, naming the
    option and the field (its warning, if it was measured elsewhere, comes with the report)."""
    if not isinstance(path, str):
        raise ConfigError(f"{option_name(field)} must be the path of a costs file, got {path!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_costs(path)
    except PipetrainError as error:
        raise ConfigError(f"{option_name(field, path)}: {error}") from None


def _optimizer(args: argparse.Namespace) -> str:
    """``--optimizer``, translated by ``--translate-from-batch`` (docs/design.md 3.5)."""
    if not args.translate_from_batch:
        return args.optimizer

    spec = parse_optimizer_spec(args.optimizer)
    if spec.name != "sgd":
        raise ConfigError(f"{option_name('translate_from_batch')} translates SGD hyper-parameters; give an sgd:... "
                          f"{option_name('optimizer')}")
    options = dict(spec.options)
    if args.batch_size != 1:
        raise ConfigError(f"{option_name('translate_from_batch')} translates to batch size 1: use it with "
                          f"{option_name('batch_size', 1)}")
    translated = translate_hyperparameters(
        args.translate_from_batch, float(options.get("lr", 1e-3)), float(options.get("momentum", 0.0)),
        float(options.get("weight_decay", 0.0)),
    )
    options.update(lr=translated.lr, momentum=translated.momentum)
    return "sgd:" + ",".join(f"{k}={v}" for k, v in options.items())


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and not args.quiet and sys.stderr.isatty()


def _fraction(field: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and 0 < value < 1):
        raise ConfigError(f"{option_name(field)} must be a fraction between 0 and 1 (e.g. 0.2), got {value!r}")


def _fp16(config: TrainConfig) -> bool:
    return config.precision == "fp16"


_DATA, _PIPELINE, _TRAINING, _EXECUTION, _OUTPUTS = "model and data", "pipeline", "training", "execution", "outputs"


@dataclass
class TrainConfig:
    """Everything a training run needs to be reproduced (the `pipetrain train` options)."""

    # -- model and data ----------------------------------------------------------------------
    model: str = option(
        "mlp:depth=2,width=128", group=_DATA, fingerprint=True,
        help="built-in name (mlp, resmlp, resnet-gn, resnet-gn-skip, gpt) or PKG.MOD:FACTORY, "
             "with optional :k=v,... (default mlp:depth=2,width=128)")
    data: str = option(
        "digits", group=_DATA, fingerprint=True,
        help="digits, synthetic:features=N,classes=C,samples=K, or PKG.MOD:FACTORY (default digits)")
    test_data: str | None = option(
        None, group=_DATA, api="fit", keyword="eval_data", api_type="Any",
        help="a separate held-out data spec (default: the data's own test split)")
    holdout: float | None = option(
        None, check=_fraction, group=_DATA, type=float, metavar="FRACTION", fingerprint=lambda c: c.holdout is not None,
        help="hold out this fraction of --data (a fixed split) for evaluation instead (default: none; "
             "a data factory without split= then has no held-out data)")
    data_workers: int | None = option(
        None, check=whole_number(0, " (0 reads on the training thread)"), group=_DATA, type=int, metavar="N",
        help="DataLoader worker processes reading a plain Dataset ahead, 0 for the training thread "
             "(default 1; two-tensor and batch() data sets are read by index on a thread)")
    pin_memory: bool = option(
        False, group=_DATA, action="store_true", help="page-locked batches, with an accelerator (default off)")
    init: Init | None = option(
        None, group=_DATA, from_cli=_init, api="pipeline", api_type="str | Callable[[nn.Module, str], Any] | None",
        help="first values of a model built on meta: \"reset\", a weights directory (--init-from), or the "
             "Python API's init function (module, name); None: the model's own values",
        flags=(Flag("--init-from", "start from the weights in DIR (written by --save DIR, or a HuggingFace "
                    "save_pretrained directory): each worker reads only its stages' tensors; implies --init meta "
                    "unless --init eager (default: none)", {"metavar": "DIR"}),
               Flag("--init", "meta: build the model on PyTorch's meta device (shapes, no memory); each worker "
                    "materialises only its own stages, initialised by each module's reset_parameters() under "
                    "--seed, or from --init-from (default: eager, unless --init-from is given)",
                    {"choices": ["eager", "meta"], "default": None})))
    # -- pipeline ----------------------------------------------------------------------------
    schedule: str | None = option(
        None, group=_PIPELINE, fingerprint=True, api="pipeline",
        help="gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, v-half, v-min, zb-auto, bfs, interleaved-zb, dualpipev, "
             "pipedream, 2bw, pb, or torch's names (GPipe, Interleaved1F1B, LoopedBFS, ZBVZeroBubble, ...); auto: "
             "the synchronous one that simulates fastest for --stages (ranks) and --microbatches within 1f1b's "
             "activations (auto:memory=X: X times them; docs/planner.md) (default: the plan's, else 1f1b)")
    stages: int | None = option(
        None, check=at_least(1), group=_PIPELINE, type=int, fingerprint=True, api="pipeline",
        help="number of pipeline stages (ranks for the looped schedules interleaved, bfs, interleaved-zb and the V "
             "schedules zb-v, v-half, v-min, dualpipev, whose ranks hold several chunks), cut as --balance-by says "
             "(default: as many as "
             "--balance, --split-at or --replicas give, else --workers, else 2)")
    balance: list[int] | None = option(
        None, check=entries_at_least(1), group=_PIPELINE, type=int_list, fingerprint=True, api="pipeline", from_api=list, api_type="Sequence[int] | None",
        help="modules per stage, e.g. 2,2,1 (default: --stages cut as --balance-by says)")
    split_at: list[str] | None = option(
        None, group=_PIPELINE, type=name_list, fingerprint=True, api="pipeline", from_api=list, api_type="Sequence[str] | None",
        help="module names that start a new stage (default: --stages cut as --balance-by says)")
    balance_by: str = option(
        "auto", group=_PIPELINE, choices=["auto", "time", "params"],
        help="what --stages S balances: measured time (time), parameter count (params), or auto: "
             "time on synchronous schedules, where the cut cannot change the result, parameter count "
             "on asynchronous ones, with dropout or with tied weights (default auto)")
    leaf_modules: list[str] | None = option(
        None, group=_PIPELINE, type=name_list, metavar="NAMES", fingerprint=lambda c: bool(c.leaf_modules),
        api="pipeline", api_default=(), api_type="Sequence[str | type]",
        help="modules a traced model calls whole, by qualified name or class name (e.g. "
             "blocks.0.attn or Attention); a stage cannot start inside them (default: none)")
    concrete_args: dict[str, Any] | None = option(
        None, group=_PIPELINE, type=key_values, metavar="K=V,...", fingerprint=lambda c: bool(c.concrete_args),
        api="pipeline",
        help="values fixed for non-tensor forward arguments when tracing, e.g. use_cache=false "
             "(default: each argument's own default)")
    plan: str | None = option(
        None, group=_PIPELINE, api="pipeline",
        help="a plan JSON from `pipetrain plan --out`: its stages, replicas, schedule and microbatches "
             "(default: none)")
    replicas: list[int] | None = option(
        None, check=entries_at_least(1), group=_PIPELINE, type=int_list, fingerprint=True, api="pipeline",
        from_api=lambda replicas: list(replicas) or None, api_type="Sequence[int] | None", help="replicas per stage, e.g. 2,1 (default: 1 each)")
    chunks: int = option(
        1, check=at_least(1), group=_PIPELINE, type=int, fingerprint=True, api="pipeline",
        help="model chunks per rank (interleaved, bfs, interleaved-zb; dualpipev holds 2; default 1)")
    policy: str | None = option(
        None, group=_PIPELINE, fingerprint=True, api="pipeline",
        help="weight-version policy replacing the schedule's: stash, vsync, latest, predict (default: the "
             "schedule's own; predict with --compensation lwp)")
    microbatches: int | None = option(
        None, check=at_least(1), group=_PIPELINE, type=int, fingerprint=True, api="pipeline",
        help="microbatches per update (default 4; 1 for pipedream and pb)")
    # -- training ----------------------------------------------------------------------------
    batch_size: int = option(
        32, check=at_least(1), group=_TRAINING, type=int, fingerprint=True, api="fit", api_default=None, api_type="int | None",
        help="samples per optimizer update (default 32)")
    steps: int | None = option(
        None, check=at_least(1), group=_TRAINING, type=int, api="fit", help="optimizer updates (default: those of --epochs)")
    epochs: float | None = option(
        None, check=at_least(0, strict=True), group=_TRAINING, type=float, api="fit",
        help="passes over the training data (default 1 when --steps is absent)")
    optimizer: str = option(
        "sgd:lr=0.02,momentum=0.9", group=_TRAINING, fingerprint=True, from_cli=_optimizer,
        api="pipeline", api_default="sgd:lr=0.01", api_type="str | type | OptimizerFactory",
        help="sgd:lr=..,momentum=..,nesterov=..,weight_decay=.., adam:lr=..,betas=../.. or adamw:... "
             "(default sgd:lr=0.02,momentum=0.9)",
        flags=(Flag("--optimizer", "sgd:lr=..,momentum=..,nesterov=..,weight_decay=.., adam:lr=..,betas=../.. or "
                    "adamw:... (default sgd:lr=0.02,momentum=0.9)"),
               Flag("--translate-from-batch", "treat --optimizer's lr and momentum as tuned for batch B and "
                    "translate them to --batch-size (default: no translation)", {"type": int, "metavar": "B"})))
    lr_schedule: str | None = option(
        None, group=_TRAINING, fingerprint=True, api="pipeline", keyword="lr_scheduler", api_type="str | Callable[[Any], Any] | None",
        help="constant, step:milestones=a/b,gamma=.., cosine:total=.., end:total=..,fraction=.., counted in "
             "samples (default: constant)")
    compensation: str = option(
        "none", group=_TRAINING, fingerprint=True, api="pipeline",
        help="none, sc, lwp, dlr (delay-scaled lr; dlrN: reference delay N), dts (delay time scaling: "
             "lr and momentum; dtsN), dtsf (dts that follows --lr-schedule; dtsfN), dtt (dts at SGD's temperature "
             "lr/(1-m); dttN) or a combination such as sc+lwp+dlr16 or sc+lwp+dts4, delays "
             "from the schedule (default none)")
    seed: int = option(
        0, group=_TRAINING, type=int, fingerprint=True, api="pipeline",
        help="seed of the model's initial weights, the data order and dropout (default 0)")
    shuffle: bool = option(
        True, group=_TRAINING, fingerprint=True, api="fit", from_cli=lambda args: not args.no_shuffle,
        help="a fresh order of the samples each epoch; off: update t consumes samples tB..(t+1)B-1 in order",
        flags=(Flag("--no-shuffle", "update t consumes samples tB..(t+1)B-1 in order", {"action": "store_true"}),))
    dtype: str | None = option(
        "float32", group=_TRAINING, choices=["float32", "float64"], fingerprint=True,
        help="parameters and floating-point inputs (default float32)")
    device: str = option(
        "auto", group=_TRAINING, choices=["auto", "cpu", "cuda"], api="pipeline",
        help="where the stages compute: cuda (each worker on GPU LOCAL_RANK, the emulator on one GPU), "
             "cpu, or auto: CUDA when available (default auto)")
    precision: str = option(
        "fp32", group=_TRAINING, choices=["fp32", "bf16", "fp16"], api="pipeline",
        fingerprint=lambda c: c.precision != "fp32",  # recompute: the same numbers
        help="bf16 or fp16: each stage's forward under torch.autocast (also on CPU), float32 master "
             "weights and optimizer state; fp16 with a loss scale every stage agrees on "
             "(docs/gpu.md) (default fp32)")
    loss_scale: str = option(
        "dynamic", group=_TRAINING, metavar="dynamic|FLOAT", fingerprint=_fp16, api="pipeline", from_api=str, api_type="str | float",
        help="--precision fp16: dynamic (halve on overflow, double after --loss-scale-growth clean "
             "updates) or a fixed power of two (default dynamic)")
    loss_scale_init: float = option(
        65536.0, group=_TRAINING, type=float, metavar="FLOAT", fingerprint=_fp16, api="pipeline",
        help="--precision fp16, dynamic scale: the first scale, a power of two (default 65536)")
    loss_scale_growth: int = option(
        2000, group=_TRAINING, type=int, metavar="N", fingerprint=_fp16, api="pipeline",
        help="--precision fp16, dynamic scale: clean updates after which the scale doubles (default 2000)")
    recompute: str | None = option(
        None, group=_TRAINING, metavar="none|stage|stage:LIST", api="pipeline",
        help="stage: keep only each stage's inputs between a forward and its backward and run the "
             "forward again in the backward, on the same weight version and random numbers "
             "(less activation memory, about one more forward; same results); stage:0,2: on "
             "those stages only (default: the --plan's choice, else none)")
    on_nonfinite: str = option(
        "stop", check=one_of("stop", "skip", "off"), group=_TRAINING, choices=["stop", "skip"], api="pipeline",
        help="a NaN or infinite loss or gradient: stop the run naming the step and stage (default "
             "stop), or skip each update whose gradient is not finite (see docs/optim.md)")
    eval_every: int = option(
        0, check=at_least(0), group=_TRAINING, type=int, api="fit",
        help="evaluate on held-out data every K updates and at the end, printing each result "
             "(default 0: at the end only)")
    eval_samples: int | None = option(
        None, check=at_least(0), group=_TRAINING, type=int, api="fit",
        help="evaluate on the first N held-out samples only (default: all)")
    # -- execution ---------------------------------------------------------------------------
    executor: str = option(
        "distributed", group=_EXECUTION, choices=["distributed", "emulate"], api="pipeline",
        help="distributed (one process per stage replica) or emulate (one process) (default distributed)")
    workers: int | None = option(
        None, check=at_least(1), group=_EXECUTION, type=int, help="worker processes (default: one per stage replica)")
    threads_per_worker: int = option(
        1, check=at_least(1), group=_EXECUTION, type=int, api="pipeline",
        help="PyTorch threads of each worker process, and of the emulator (default 1)")
    receives: str = option(
        "auto", group=_EXECUTION, choices=["auto", "on-demand", "ahead"], api="pipeline",
        help="distributed: post each receive when it is reached (on-demand), keep every channel's "
             "next receive posted (ahead), or on-demand where provably deadlock-free and the backward is not "
             "split (auto) (default auto)")
    timeout: float = option(
        60.0, check=at_least(0, strict=True), group=_EXECUTION, type=float, api="pipeline",
        help="seconds any blocking wait may take, joining the run included (default 60)")
    max_restarts: int = option(
        0, check=at_least(0), group=_EXECUTION, type=int, metavar="N", api="fit",
        help="start the workers again after a failure that is not a user error, up to N times; "
             "they resume from --checkpoint-dir (under torchrun use torchrun's own "
             "--max-restarts) (default 0)")
    # -- outputs -----------------------------------------------------------------------------
    save: str | None = option(
        None, group=_OUTPUTS, api="fit",
        help="write the trained weights under the unsplit model's names: into a directory "
             "(a path without a suffix) as safetensors shards, each worker its own "
             "stages, with HuggingFace's index (from_pretrained reads it; pipetrain.load_weights too); or "
             "into one file gathered on rank 0: torch.save's (.pt, .pth, .bin, .ckpt) or safetensors' "
             "(.safetensors); another suffix is refused (default: not saved)")
    report_json: str | None = option(
        None, group=_OUTPUTS, api="fit",
        help="write a JSON report: samples_per_s, final_loss, steps, ... and, on the distributed "
             "runtime, the measured and the simulated seconds per update (default: none)")
    costs_file: str | None = option(
        None, group=_OUTPUTS, check=_calibration, metavar="FILE", api="fit",
        help="a calibration from `pipetrain calibrate`: the report's and the plot's simulated time "
             "charge its communication and per-action costs besides the measured unit times "
             "(default: none, compute only)")
    calibrate: bool = option(
        False, group=_OUTPUTS, action="store_true", api="fit",
        help="measure this machine's message and per-action costs first (pipetrain calibrate, about 10 s) "
             "and use them as the costs file, written to --costs-file (default calibration.json); a "
             "worker of a run started by torchrun reads the file rank 0's launcher wrote before")
    trace: str | None = option(
        None, group=_OUTPUTS, api="fit",
        help="write the measured per-action timeline as a Chrome/Perfetto trace (default: none)")
    plot: str | None = option(
        None, group=_OUTPUTS, api="fit",
        help="draw the measured timeline next to the simulated one, PNG (default: none)")
    checkpoint_dir: str | None = option(
        None, group=_OUTPUTS, api="fit",
        help="checkpoint the run into this directory, and resume from its newest "
             "complete checkpoint when it holds one (else start afresh, saying which): one command line "
             "for the first start and every restart (default: no checkpoints)")
    checkpoint_every: int = option(
        0, check=at_least(0), group=_OUTPUTS, type=int, api="fit",
        help="with --checkpoint-dir, checkpoint after every K updates, and after the last (default 0: "
             "about ten checkpoints per run, every ceil(steps / 10) updates)")
    keep: int = option(
        2, check=at_least(1), group=_OUTPUTS, type=int, metavar="K", api="fit",
        help="complete checkpoints kept in --checkpoint-dir, the newest (default 2)")
    resume: bool | str = option(
        False, group=_OUTPUTS, nargs="?", const=True, metavar="CHECKPOINT", api="fit",
        help="continue from the newest complete checkpoint in --checkpoint-dir, an error if there is "
             "none, or from the named step directory, refused if it is incomplete or damaged "
             "(default: --checkpoint-dir's newest if any, else start afresh)")
    extend: bool = option(
        False, group=_OUTPUTS, action="store_true", api="fit",
        help="continue a finished (or interrupted) asynchronous run for more updates (a longer --steps "
             "or --epochs): its pipeline drains where it ended and fills again, so the result is the "
             "run extended, not the uninterrupted longer run (the data line says so)")
    progress: bool = option(
        True, group=_OUTPUTS, from_cli=_progress, api="fit", api_default=None, api_type="bool | None",
        help="a progress bar (the command line shows it on a terminal only; Python's default: on a terminal)",
        flags=(Flag("--no-progress", "no progress bar (it is shown only when stderr is a terminal)",
                    {"action": "store_true"}),))
    quiet: bool = option(
        False, group=_OUTPUTS, action="store_true", api="fit",
        help="print only the final line: not the chosen stages, nor --eval-every's results as they come")
    # -- set by the run, not by the user --------------------------------------------------------
    extra: dict[str, str] = option(flag=False, default_factory=dict, help="free-form notes of the run")
    drain_at: tuple[int, ...] = option(
        (), flag=False, help="updates after which the pipeline drains (--extend sets them from the checkpoint)")

    def __post_init__(self) -> None:
        # the one place a Python value of init ("reset", a path, a function) becomes its Init; the
        # command line's flags give one already (--init eager --init-from DIR has no Python spelling)
        self.init = resolve_init(self.init)

    def fingerprint(self) -> dict[str, object]:
        """What a checkpoint must agree on to be resumed by this run: the options declared
        ``fingerprint=`` (always, or when their condition holds)."""
        return {field.name: getattr(self, field.name) for field, declaration in declared(TrainConfig)
                if declaration.fingerprint is True
                or (callable(declaration.fingerprint) and declaration.fingerprint(self))}


name_options(flag_of(TrainConfig), keyword_of(TrainConfig))
