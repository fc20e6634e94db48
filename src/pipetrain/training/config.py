"""The options of a training run, with the defaults of `pipetrain train` in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Everything a training run needs to be reproduced (the `pipetrain train` options)."""

    model: str = "mlp:depth=2,width=128"
    data: str = "digits"
    test_data: str | None = None
    holdout: float | None = None  # fraction of --data held out for evaluation (default: none)
    schedule: str | None = None  # None: the plan's, else 1f1b
    stages: int | None = None
    balance: list[int] | None = None
    split_at: list[str] | None = None
    plan: str | None = None
    balance_by: str = "auto"  # --stages S balances: auto (time on synchronous schedules), time, params
    stage_costs: dict[str, float] | None = None  # measured seconds per unit that cut the model (reused by workers)
    leaf_modules: list[str] | None = None  # modules a traced model calls whole (names or class names)
    concrete_args: dict[str, Any] | None = None  # values fixed for non-tensor forward arguments when tracing
    replicas: list[int] | None = None
    chunks: int = 1
    policy: str | None = None
    microbatches: int | None = None
    batch_size: int = 32
    steps: int | None = None
    epochs: float | None = None
    optimizer: str = "sgd:lr=0.02,momentum=0.9"
    lr_schedule: str | None = None
    compensation: str = "none"
    executor: str = "distributed"
    workers: int | None = None
    threads_per_worker: int = 1
    receives: str = "auto"  # runtime: when receives are posted (auto, on-demand, ahead)
    timeout: float = 60.0
    seed: int = 0
    shuffle: bool = True
    dtype: str = "float32"
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient: stop the run, or skip the update (docs/optim.md)
    eval_every: int = 0
    eval_samples: int | None = None  # held-out samples evaluated (default: all)
    save: str | None = None
    report_json: str | None = None
    trace: str | None = None
    plot: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool | str = False  # False: --checkpoint-dir's newest checkpoint if any; True: it must exist
    keep: int = 2  # complete checkpoints kept (training.checkpoints.DEFAULT_KEEP)
    extend: bool = False  # continue a finished asynchronous run for more updates (its pipeline drains at its end)
    drain_at: tuple[int, ...] = ()  # updates after which the pipeline drains (--extend sets them from the checkpoint)
    max_restarts: int = 0  # spawned workers: start them again this many times after a failure
    progress: bool = True  # a progress bar (the command line shows it on a terminal only)
    quiet: bool = False  # no lines before and during training (the chosen stages, --eval-every's results)
    extra: dict[str, str] = field(default_factory=dict)
    data_workers: int | None = None  # DataLoader worker processes for plain data sets (None: the default, 1)
    pin_memory: bool = False  # page-locked batches (with an accelerator)
    recompute: str | None = None  # none, stage (every stage keeps its inputs only, recomputes in the backward),
    # stage:0,2 (those stages); None: the plan's choice, else none
    precision: str = "fp32"  # fp32, bf16 or fp16 (autocast in each stage's forward, fp32 master weights)
    loss_scale: str = "dynamic"  # fp16: dynamic (start at loss_scale_init, halve on overflow) or a fixed power of two
    loss_scale_init: float = 65536.0  # fp16, dynamic: the first scale (execution.scaling.DEFAULT_INIT)
    loss_scale_growth: int = 2000  # fp16, dynamic: clean updates after which the scale doubles
    device: str = "auto"  # auto (CUDA when available), cpu or cuda: where every stage computes
    meta: bool = False  # --init meta: the command line builds the model on the meta device (no values)
    init: str | None = None  # first values of a model built on meta: "reset", a weights directory (--init-from),
    # or the description of the Python API's init function; None: the model's own values

    def fingerprint(self) -> dict[str, object]:
        """What a checkpoint must agree on to be resumed by this run."""
        return {
            "model": self.model, "data": self.data, "schedule": self.schedule, "stages": self.stages,
            "balance": self.balance, "split_at": self.split_at, "replicas": self.replicas, "chunks": self.chunks,
            "policy": self.policy, "microbatches": self.microbatches, "batch_size": self.batch_size,
            "optimizer": self.optimizer, "lr_schedule": self.lr_schedule, "compensation": self.compensation,
            "seed": self.seed, "shuffle": self.shuffle, "dtype": self.dtype,
            **{key: value for key, value in (("leaf_modules", self.leaf_modules), ("concrete_args", self.concrete_args),
                                             ("stage_costs", self.stage_costs)) if value},
        } | ({"holdout": self.holdout} if self.holdout is not None else {}) | (  # which samples train
            {"precision": self.precision} if self.precision != "fp32" else {}) | (  # recompute: the same numbers
            {"loss_scale": self.loss_scale, "loss_scale_init": self.loss_scale_init,
             "loss_scale_growth": self.loss_scale_growth} if self.precision == "fp16" else {})
