"""The Python entry point: train a model (or a list of stage modules) with any schedule, on the
emulator or on worker processes, with ``fit`` or from your own loop with ``step``.

>>> import torch, torch.nn as nn
>>> from pipetrain import Pipeline
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> pipe = Pipeline(model, balance=[2, 1], schedule="1f1b", microbatches=4,
...                 optimizer=torch.optim.SGD, optimizer_options=dict(lr=0.1, momentum=0.9), executor="emulate")
>>> x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
>>> losses = pipe.train([(x, y)] * 3)          # three updates of one 32-sample batch each
>>> len(losses)
3

With ``executor="distributed"`` (the default) the same code runs on one worker process per stage
replica. Run as ``python train.py``, the script starts itself once per worker; under ``torchrun``
every process is already a worker. Either way every rank runs the whole script, builds the same
model, and only the rank of stage 0 reads data. See docs/api.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from pipetrain.errors import ArgumentError, ConfigError, option
from pipetrain.models.loss import loss_for
from pipetrain.optim import build_stage_optimizer, parse_compensation
from pipetrain.optim.torch_optim import SchedulerLR, TorchOptimizer, as_spec, is_torch_optimizer
from pipetrain.plan.choose import is_auto
from pipetrain.runtime.launch import detect
from pipetrain.schedule import resolve_name
from pipetrain.schedule.presets import chunks_per_rank
from pipetrain.stages import StageChoice, split_model
from pipetrain.training import distributed
from pipetrain.training.api_types import checked_value
from pipetrain.training.config import TrainConfig
from pipetrain.training.cutting import check_auto, choose_by_parameters, unit_names_of
from pipetrain.training.options import api_signature, api_values
from pipetrain.training.outputs import HeldOut
from pipetrain.training.parts import OptimizerFactory, RunParts, describe_data, describe_model
from pipetrain.training.result import TrainResult
from pipetrain.training.scheduling import ranks_of_balance, resolved_microbatches
from pipetrain.training.setup import apply_plan, prepare
from pipetrain.training.stepping import DistributedSession, EmulatedSession
from pipetrain.training.train import train
from pipetrain.training.validate import check_config, check_optimizer_specs

__all__ = ["Pipeline"]

_EXECUTORS = ("distributed", "emulate")


class Pipeline:
    """A model cut into stages, a schedule and an optimizer: trained with :meth:`fit`, or one batch
    at a time from your own loop with :meth:`start`, :meth:`step` and :meth:`finish`.

    Model:
        model: an ``nn.Sequential`` (cut by ``balance``, ``split_at`` or into ``stages``), any
            ``nn.Module`` torch.fx can trace (cut at ``split_at`` module names or into
            ``stages``; ``leaf_modules`` and ``concrete_args`` go to the tracer), or a list of stage
            modules. Build it the same way on every rank (seed it): each rank trains its stages.
        plan: a plan JSON written by ``pipetrain plan --out`` (stages, replicas, schedule).
        init: the first values of a model built under ``torch.device("meta")`` (shapes, no values
            and no memory: every rank builds it whole, cuts it, and materialises only the stages it
            runs, so no process holds the whole model): ``"reset"`` (each module's
            ``reset_parameters()`` under a seed from ``seed`` and the module's name, the same for
            every cut and executor), a function ``init(module, name)``, or a weights directory
            (``save=DIR``'s or HuggingFace's ``save_pretrained``'s: each rank reads its own tensors).
            A directory also starts an eagerly built model from its weights. See docs/models.md.
    Schedule:
        schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, v-half, v-min, zb-auto, bfs, interleaved-zb,
            dualpipev, pipedream, 2bw or pb (docs/design.md section 3), or torch's name of one
            (``"Interleaved1F1B"``, ...); ``stages`` counts ranks for the looped schedules (interleaved, bfs,
            interleaved-zb) and the V schedules (zb-v, v-half, v-min, dualpipev: the model is cut into two
            stages per rank). ``"auto"`` (or ``"auto:memory=X"``): the synchronous schedule that simulates
            fastest over ``stages`` ranks and ``microbatches`` within 1f1b's activations (X times them),
            each unit priced by its parameter count (:mod:`pipetrain.plan.choose`); printed and reported.
        microbatches: units per update (microbatches per step; pipedream/pb: minibatches or
            samples accumulated per update, default 1); ``replicas``, ``chunks``, ``policy`` as for
            :func:`pipetrain.schedule.build`.
    Training:
        loss_fn: ``loss_fn(output, target)``, a mean over samples (default: the model's
            ``pipeline_loss``, else cross entropy).
        optimizer: a ``torch.optim.Optimizer`` class with ``optimizer_options`` (SGD, Adam and
            AdamW run as pipetrain's own bitwise-equal functional optimizers; any other class runs
            as itself, see :mod:`pipetrain.optim.torch_optim`), an optimizer spec
            (``"sgd:lr=0.1,momentum=0.9"``), or a factory ``(stage, delay) -> StageOptimizer``.
        lr_scheduler: ``lr_scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler``
            (stepped once per update of each stage), or a sample-counting spec such as
            ``"cosine:total=10000"`` (see docs/optim.md).
        compensation: ``none``, ``sc``, ``lwp``, ``dlr[N]``, ``dts[N]``, ``dtsf[N]``, ``dtt[N]`` or a ``+`` of them, such as
            ``sc+lwp+dts4`` (docs/optim.md; momentum SGD; LWP and DLR also Adam).
        seed: the data order and dropout; model initialisation is yours.
        on_nonfinite: ``stop`` (a NaN or infinite loss ends the run with a
            :class:`~pipetrain.errors.NonFiniteError` naming the step and stage) or ``skip``
            (drop each update whose gradient is not finite); see docs/optim.md.
    Execution:
        executor: ``distributed`` (worker processes over torch.distributed) or ``emulate`` (this
            process; bitwise the same parameters).
        threads_per_worker, receives, timeout: as ``pipetrain train``'s options.
        recompute: ``none``, ``stage`` (each stage keeps only its inputs and runs its forward
            again in the backward, on the same weight version: the same results with less
            activation memory; see docs/gpu.md), or ``stage:0,2`` (those stages only); default:
            the plan's choice, else ``none``.
        precision: ``fp32``, ``bf16`` or ``fp16`` (each stage's forward under ``torch.autocast``,
            float32 master weights and optimizer state; also on CPU); fp16 with a loss scale that
            every stage agrees on (docs/gpu.md).
        loss_scale, loss_scale_init, loss_scale_growth: fp16's scale, as ``pipetrain train``'s
            ``--loss-scale`` (``"dynamic"`` or a power of two), ``--loss-scale-init`` and
            ``--loss-scale-growth``.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``: where the stages compute (each
            worker on its GPU ``LOCAL_RANK``); ``model`` ends on that device.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        *,
        loss_fn: Callable[[Any, Tensor], Tensor] | None = None,
        optimizer_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """``options``: the keywords declared ``api="pipeline"`` in
        :class:`~pipetrain.training.config.TrainConfig` (the signature lists them)."""
        _check_model(model)
        _check_loss_fn(loss_fn)
        values = api_values(TrainConfig, "pipeline", options, "Pipeline()")
        init, leaf_modules, concrete_args = values.pop("init"), values.pop("leaf_modules"), values.pop("concrete_args")
        if values["executor"] not in _EXECUTORS:
            raise ConfigError(f"unknown executor {values['executor']!r}; choose one of {', '.join(_EXECUTORS)}")
        spec, lr_schedule, factory = _optimizer_parts(values.pop("optimizer"), optimizer_options,
                                                      values.pop("lr_schedule"), values["compensation"])
        config = TrainConfig(
            **values, model=describe_model(model), data="", optimizer=spec, lr_schedule=lr_schedule, dtype=None,
            progress=sys.stderr.isatty(), init=init,
        )

        check_config(config, specs=False)  # each option's own check, as fit() makes them again: here, at once
        config = apply_plan(config)  # after the check, which refuses stages beside a plan (the plan's own too)
        if factory is None:  # pipetrain's own optimizer, from its spec (and the compensation, lr schedule)
            check_optimizer_specs(spec, config.compensation, lr_schedule)
        choice = None
        if is_auto(config.schedule):
            config, choice = _choose_auto(config, model, leaf_modules, concrete_args)
        self.schedule_name = resolve_name(config.schedule)
        if self.schedule_name == "zb-auto" and config.microbatches is None:
            raise ConfigError(f"zb-auto chooses its order (and whether each rank holds two chunks) for a number of "
                              f"microbatches: give {option('microbatches')}")
        units = resolved_microbatches(config, self.schedule_name)
        if config.stages is None and config.balance and not config.replicas:
            ranks = ranks_of_balance(config, self.schedule_name, len(config.balance), units)
        else:
            ranks = config.stages or 2
        pieces_per_rank = chunks_per_rank(self.schedule_name, ranks, units, config.chunks)
        if isinstance(model, (list, tuple)):
            self.staged = split_model(list(model))
            how = "stage modules"
        else:
            if config.stages is not None:  # beside balance or split_at it must agree with them
                count = config.stages * pieces_per_rank
            else:
                count = None if config.balance or config.split_at else 2 * pieces_per_rank
            self.staged = split_model(model, stages=count, balance=config.balance, split_at=config.split_at,
                                      leaf_modules=leaf_modules, concrete_args=concrete_args)
            how = (f"plan={config.plan!r}" if config.plan else f"balance={config.balance}" if config.balance
                   else f"split_at={config.split_at}" if config.split_at else "parameter count")
        self.model = model
        self._config = dataclasses.replace(
            config, stages=len(self.staged.stages) // pieces_per_rank, balance=None, split_at=None, plan=None
        )
        unsplit = nn.Sequential(*model) if isinstance(model, (list, tuple)) else model

        self._parts = RunParts(model=model, train_set=None, test_set=None,
                               loss_fn=loss_fn or loss_for(unsplit), optimizer=factory, staged=self.staged,
                               stage_choice=StageChoice.of(self.staged, how, unit_names_of(unsplit)),
                               schedule_choice=choice)
        self._session: Any = None
        self._run: Any = None
        self.last_schedule = None
        self.last_result: TrainResult | None = None

    # -- what it is --------------------------------------------------------------------------------

    @property
    def stages(self) -> list[nn.Module]:
        """The stage modules (they share their parameters with ``model``)."""
        return list(self.staged.stages)

    @property
    def executor(self) -> str:
        return self._config.executor

    @property
    def rank(self) -> int:
        """This process's rank in a distributed run (0 on the emulator and before one starts)."""
        return int(os.environ.get("RANK", "0")) if self.executor == "distributed" else 0

    @property
    def is_main(self) -> bool:
        """Whether this process reports for the run: the emulator's, or rank 0 of a distributed
        run (it holds the whole trained model after :meth:`fit` or :meth:`finish`, unless the model
        was built on the meta device: then every rank holds its own stages, and ``save=DIR``
        writes them all)."""
        return self.rank == 0

    @property
    def reads_data(self) -> bool:
        """Whether this rank uses the batches given to :meth:`step` (it holds stage 0); known once
        :meth:`start` has run. Other ranks may pass nothing and skip reading their loader."""
        run = self._active("reads_data").run
        return self.executor == "emulate" or 0 in run.schedule.rank_stages()[self.rank]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the unsplit model's keys (after a distributed run: complete on the
        main rank, each other rank's own stages trained; of a model built on meta, each rank's
        own stages, the others' still on meta)."""
        return self.staged.merge_state_dict([stage.state_dict() for stage in self.staged.stages])

    # -- training with fit ---------------------------------------------------------------------

    def fit(self, data: Any, *, callbacks: Iterable[Any] = (), **options: Any) -> TrainResult:
        """Train on ``data`` (a map-style ``Dataset`` of ``(x, y)``, or a ``DataLoader``) for
        ``epochs`` passes or ``steps`` updates of ``batch_size`` samples (default one epoch, 32
        samples), evaluating on ``eval_data`` every ``eval_every`` updates and at the end.

        A ``Dataset`` is batched, shuffled (``shuffle``) and read ahead by pipetrain, each update
        under its own seed (docs/data.md). A ``DataLoader`` is read as it is, one of its batches
        per update, with its own sampler, workers and ``pin_memory``: ``batch_size`` defaults to
        the loader's and ``shuffle`` does not apply. ``eval_data`` may be either too (a loader's
        data set is evaluated).

        ``callbacks``: :class:`~pipetrain.training.callbacks.Callback` objects (or functions
        ``f(step, loss)``), called where the information is. Checkpoints (``checkpoint_dir``,
        ``checkpoint_every``, ``resume``, ``keep``) and the outputs (``save``: the unsplit ``state_dict``
        in one file, ``torch.save``'s (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) or safetensors'
        (``.safetensors``), or with a path without a suffix a weights directory written stage by stage,
        see :mod:`pipetrain.weights`; another suffix is refused,
        ``report_json``, ``trace``, ``plot``) are those of ``pipetrain train``; so are the lines
        printed before and during training (the chosen stages, each evaluation), which ``quiet``
        leaves out, and the progress bar (default: on a terminal). Returns the
        :class:`~pipetrain.training.result.TrainResult`; ``model`` holds the trained weights.

        ``checkpoint_dir`` alone resumes from its newest complete checkpoint when there is one, so
        running the script again continues an interrupted run. ``max_restarts`` (distributed,
        when ``python train.py`` starts the workers itself) starts every worker again after a
        failure that is not a user error, up to that many times; they resume from
        ``checkpoint_dir``. Under torchrun, use torchrun's ``--max-restarts`` instead. ``extend``
        continues a finished asynchronous run for more ``steps`` or ``epochs`` (``--extend``): its
        pipeline drains where it ended, so the result is not the uninterrupted longer run.
        """
        self._refuse_during_session("fit")
        values = api_values(TrainConfig, "fit", options, "fit()")
        eval_data, batch_size, progress = values.pop("test_data"), values.pop("batch_size"), values.pop("progress")
        loader = isinstance(data, torch.utils.data.DataLoader)
        if batch_size is None:
            batch_size = data.batch_size if loader else 32
            if batch_size is None:
                raise ConfigError("the DataLoader has no batch_size (it has a batch_sampler): give fit(batch_size=B), "
                                  "the size of each of its batches")
        shuffle = values.pop("shuffle") and not loader
        config = dataclasses.replace(
            self._config, **values, data=describe_data(data),
            test_data=None if eval_data is None else describe_data(eval_data), batch_size=batch_size,
            shuffle=shuffle, progress=self._config.progress if progress is None else progress,
        )
        parts = dataclasses.replace(self._parts, train_set=data if loader else _dataset(data, "data"),
                                    test_set=None if eval_data is None else _dataset(eval_data, "eval_data"))
        result = train(config, parts, callbacks)
        self.last_result = result
        if result.timeline is not None:
            self.last_schedule = result.timeline.schedule
        return result

    # -- training from your own loop -------------------------------------------------------------

    def start(self, steps: int, batch_size: int) -> None:
        """Begin a run of ``steps`` updates of ``batch_size`` samples fed by :meth:`step`.

        Distributed, outside torchrun, this starts the script once per worker and exits with
        their status when they are done (every worker runs the whole script, this call included).
        """
        self._refuse_during_session("start")
        steps = checked_value("steps", "steps", steps, "int", "start()")
        batch_size = checked_value("batch_size", "batch_size", batch_size, "int", "start()")
        config = dataclasses.replace(self._config, data="batches fed by step()", batch_size=batch_size, steps=steps,
                                     epochs=None, progress=False, data_workers=0)  # no worker for unread data
        parts = dataclasses.replace(self._parts, train_set=_Unread(), test_set=None)
        if self.executor == "emulate":
            self._caller_threads = torch.get_num_threads()  # given back by finish()
            torch.set_num_threads(config.threads_per_worker)
            self._run = prepare(config, parts)
            self._session = EmulatedSession(self._run)
        else:
            if detect() is None:
                distributed.spawn_script(prepare(config, parts))
            env = distributed.join(config)
            self._run = prepare(config, parts)
            self._session = DistributedSession(self._run, env)
        self.last_schedule = self._run.schedule

    def step(self, inputs: Any = None, targets: Tensor | None = None) -> list[tuple[int, float]]:
        """Hand over the next update's batch and run the pipeline as far as it goes without the
        one after it. Returns ``[(update, loss)]`` for the updates that finished during this call,
        on the ranks that compute the loss (the last stage's); elsewhere ``[]``. Every rank calls
        it once per update; ranks without stage 0 may pass nothing."""
        session = self._active("step")
        if isinstance(inputs, (tuple, list)) and targets is None and len(inputs) == 2:
            inputs, targets = inputs
        return session.step(inputs, targets)

    def evaluate(self, data: Any, batch_size: int | None = None) -> dict[str, float] | None:
        """Loss and accuracy of the current weights on ``data`` (a ``Dataset`` or a list of
        ``(x, y)`` batches), between two steps. Every rank of a distributed run calls it (only
        stage 0's reads ``data``), and every rank gets the metrics, once the last stage has them."""
        session = self._active("evaluate")
        held = HeldOut.of(data, batch_size or max(self._run.layout.batch_size, 64), self._run.dtype)
        if self.executor == "emulate":
            return session.evaluate([held[i] for i in range(len(held))])
        return session.evaluate(len(held), held.__getitem__)

    def finish(self) -> TrainResult:
        """End the run begun by :meth:`start` (after its last step): the result, with ``model``
        holding the trained weights (the whole model on the main rank)."""
        session = self._active("finish")
        try:
            result = session.finish()
        finally:
            threads, self._caller_threads = getattr(self, "_caller_threads", None), None
            if threads is not None:
                torch.set_num_threads(threads)
        self._session = None
        self.last_result = result
        return result

    def train(self, batches: Sequence[tuple[Any, Tensor]]) -> list[float]:
        """One update per ``(inputs, targets)`` batch; returns each update's mean loss.

        Every batch must hold the same number of samples (the samples of one update).
        """
        batches = list(batches)
        if not batches:
            raise ConfigError("train() needs at least one (inputs, targets) batch")
        wrong = next((i for i, batch in enumerate(batches) if not (isinstance(batch, (tuple, list)) and len(batch) == 2)),
                     None)
        if wrong is not None:
            raise ArgumentError(f"train() takes (inputs, targets) pairs, one per update; batch {wrong} is "
                                f"{type(batches[wrong]).__name__} {repr(batches[wrong])[:40]}")
        self.start(steps=len(batches), batch_size=int(torch.as_tensor(batches[0][1]).shape[0]))
        for inputs, targets in batches:
            self.step(inputs, targets)
        return self.finish().update_losses

    def _active(self, what: str):
        if self._session is None:
            raise ConfigError(f"{what}() needs a run begun with start(steps=..., batch_size=...)")
        return self._session

    def _refuse_during_session(self, what: str) -> None:
        if self._session is not None:
            raise ConfigError(f"{what}() while a run begun with start() is under way: finish() it first")


def _signatures() -> None:
    """The keywords of ``Pipeline(...)`` and ``fit(...)`` as their signatures show them: those
    declared in :class:`~pipetrain.training.config.TrainConfig`, after the ones of their own."""
    def own(function) -> list[inspect.Parameter]:
        return [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]

    for function, stage in ((Pipeline.__init__, "pipeline"), (Pipeline.fit, "fit")):
        function.__signature__ = api_signature(TrainConfig, stage, own(function),
                                               inspect.signature(function).return_annotation)


_signatures()


class _Unread(torch.utils.data.Dataset):
    """The data set of a run fed by ``step()``: never read (the batches come from the loop)."""

    fed_by_step = True  # the run's description says so

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        raise ConfigError("a run begun with start() reads only the batches handed to step()")


def _choose_auto(config: TrainConfig, model: Any, leaf_modules: Any, concrete_args: Any) -> tuple[TrainConfig, Any]:
    """``(config naming the chosen schedule, AutoChoice)`` for ``schedule="auto"``: the schedule
    that simulates fastest over ``stages`` ranks (:mod:`pipetrain.plan.choose`), each unit priced by
    its parameter count, as the Pipeline cuts the model (here, before any data to time it on)."""
    check_auto(config)
    if isinstance(model, (list, tuple)):
        raise ConfigError(f"{option('schedule', config.schedule)} cuts the model for the schedule it chooses: give "
                          f"the model as one module, not a list of stages, or name a schedule")
    if config.microbatches is None:
        raise ConfigError(f"{option('schedule', config.schedule)} chooses for a number of microbatches: give "
                          f"{option('microbatches')}")
    ranks = config.stages or 2
    trace = dict(leaf_modules=list(leaf_modules or ()), concrete_args=concrete_args)
    config, choice = choose_by_parameters(config, model, ranks, config.microbatches, trace)
    return dataclasses.replace(config, stages=ranks), choice


def _check_model(model: Any) -> None:
    """Refuse a model that is neither an ``nn.Module`` nor a list of them, saying what it takes."""
    takes = ("Pipeline(model) takes an nn.Module (an nn.Sequential, or any module torch.fx can trace) or a list "
             "of stage modules")
    if isinstance(model, nn.Module):
        return
    if isinstance(model, (list, tuple)):
        wrong = [(i, m) for i, m in enumerate(model) if not isinstance(m, nn.Module)]
        if model and not wrong:
            return
        got = (f"an empty {type(model).__name__}" if not model
               else f"a {type(model).__name__} whose item {wrong[0][0]} is of type {type(wrong[0][1]).__name__}")
    else:
        got = f"{repr(model)[:40]}, of type {type(model).__name__}"
    raise ConfigError(f"{takes}, not {got}")


def _check_loss_fn(loss_fn: Any) -> None:
    """Refuse a ``loss_fn`` that cannot be called as ``loss_fn(output, target)``, saying what can."""
    if loss_fn is None or (callable(loss_fn) and not (isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module))):
        return
    if isinstance(loss_fn, type):  # nn.MSELoss, not nn.MSELoss(): calling it would build a module
        raise ArgumentError(f"loss_fn is the class {loss_fn.__module__}.{loss_fn.__qualname__}: pass an instance, "
                            f"{loss_fn.__module__}.{loss_fn.__qualname__}()")
    raise ArgumentError(
        f"loss_fn must be called as loss_fn(output, target), returning the mean loss: pass a callable such as "
        f"torch.nn.MSELoss() or a function, not {type(loss_fn).__name__} {repr(loss_fn)[:40]}"
    )


def _dataset(data: Any, what: str):
    """The map-style data set of ``data`` (a ``DataLoader``'s own, for evaluation)."""
    if isinstance(data, torch.utils.data.DataLoader):
        data = data.dataset
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ConfigError(f"{what} must be a map-style Dataset of (x, y) samples, got {type(data).__name__}")
    return data


def _optimizer_parts(
    optimizer: Any, options: dict[str, Any] | None, lr_scheduler: Any, compensation: str
) -> tuple[str, str | None, OptimizerFactory | None]:
    """``(spec text, lr-schedule spec, factory)`` for the run: a spec string wherever pipetrain's own
    optimizer computes the same (so runs and checkpoints describe it in words), a factory where a
    torch optimizer or scheduler object must be built on each rank."""
    if options is not None and not is_torch_optimizer(optimizer):
        raise ConfigError("optimizer_options go with a torch.optim class (optimizer=torch.optim.SGD); "
                          "a spec string carries its own options (sgd:lr=0.1,momentum=0.9)")
    if options is not None and not isinstance(options, dict):
        raise ArgumentError(f"optimizer_options takes a dict of {optimizer.__name__}'s keyword arguments, such as "
                            f"dict(lr=0.1), not {type(options).__name__} {repr(options)[:40]}")
    if is_torch_optimizer(optimizer):
        _try_optimizer(optimizer, options or {})
    schedule_spec = lr_scheduler if isinstance(lr_scheduler, str) else None
    scheduler = None if lr_scheduler is None or isinstance(lr_scheduler, str) else lr_scheduler
    if scheduler is not None and not callable(scheduler):
        raise ConfigError("lr_scheduler must be a spec string or a function optimizer -> torch lr scheduler")
    if is_torch_optimizer(optimizer):
        spec = as_spec(optimizer, options or {})
        if spec is None:
            if (compensation or "none") != "none":
                raise ConfigError(
                    f"compensation {compensation!r} needs pipetrain's own SGD (sc, lwp, dlr, dts, dtsf, dtt) or Adam/AdamW "
                    f"(lwp, dlr), not {optimizer.__name__}"
                )
            if schedule_spec is not None:
                raise ConfigError(f"a sample-counting lr_scheduler spec drives pipetrain's own optimizers; give "
                                  f"{optimizer.__name__} a torch lr scheduler: lr_scheduler=lambda opt: ...")
            name = f"{optimizer.__module__}.{optimizer.__qualname__}({options or {}})"
            return name, None, lambda stage, delay: TorchOptimizer(optimizer, options or {}, scheduler)
        optimizer = str(spec)
    if isinstance(optimizer, str):
        if scheduler is None:
            return optimizer, schedule_spec, None

        def build(stage: int, delay: int):
            built = build_stage_optimizer(optimizer, stage_delay=delay, compensation=compensation or "none")
            built.lr_schedule = SchedulerLR(scheduler, built)
            return built

        return f"{optimizer} with {getattr(scheduler, '__name__', type(scheduler).__name__)}", None, build
    if callable(optimizer):
        if lr_scheduler is not None:
            raise ConfigError("an optimizer factory builds each stage's optimizer itself: give it its lr schedule")

        # sc, dlr, dts, dtsf and dtt live only in the optimizer the factory builds (lwp also has the forward predict)
        unused = sorted(parse_compensation(compensation or "none") - {"lwp"})
        if unused:
            raise ConfigError(
                f"an optimizer factory builds each stage's optimizer itself: give it the compensation "
                f"(build_stage_optimizer(spec, stage_delay=delay, compensation={compensation!r})); "
                f"compensation= would not reach it ({', '.join(unused)})"
            )
        return f"factory {getattr(optimizer, '__qualname__', type(optimizer).__name__)}", None, optimizer
    raise ConfigError(
        f"optimizer must be a torch.optim class, a spec string (sgd:lr=0.1) or a factory (stage, delay) -> optimizer, "
        f"not {type(optimizer).__name__}"
    )


def _try_optimizer(cls: type, options: dict[str, Any]) -> None:
    """Build ``cls(**options)`` over one stand-in parameter, so that options it does not take (a
    ``TypeError``) or values it refuses (a ``ValueError``: ``lr=-1``) are refused here rather than at
    each stage's first update. What depends on the parameters' device (``fused=True``) is left to
    the run, which builds it on the stages' own."""
    try:
        cls([nn.Parameter(torch.zeros(1))], **options)
    except (TypeError, ValueError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"optimizer {cls.__name__} does not take optimizer_options={options!r}: "
                          f"{type(error).__name__}: {first}") from None
