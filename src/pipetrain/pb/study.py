"""The PB study: train every (method, stages, lr scale, delay scale, seed) and measure it.

All methods of a row share one set of hyper-parameters, translated from the reference batch
(``pipetrain.optim.translate_hyperparameters``): no per-method tuning. Each run of seed k starts
from the same initial weights (``build_model(seed=k)``) and reads the training data in the same
order (``BatchSampler(seed=k)``), so methods are compared on paired runs. The learning rate is
constant and decays linearly to 0 over the last ``decay_fraction`` of the samples (counted in
samples, so batch-1 and batch-B runs decay alike), so that the final weights are not a noisy
iterate.

Runs that fit the batched engine (:class:`~pipetrain.pb.engine.BatchedPB`) train together, many
runs per engine; any other run falls back to the reference implementation.
"""

from __future__ import annotations

import math
import multiprocessing
import queue as queue_module
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence, TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.data import BatchSampler, dataset_info, get_batch, load_dataset, load_train_test
from pipetrain.errors import ConfigError, name_options, option
from pipetrain.models import build_model, refuse_batchnorm
from pipetrain.optim import EndDecayLR, build_stage_optimizers, translate_hyperparameters
from pipetrain.pb.engine import BatchedPB
from pipetrain.pb.groups import NotBatchable
from pipetrain.pb.methods import Method
from pipetrain.pb.reference import pb_sequential
from pipetrain.schedule import pb_delays
from pipetrain.stages import StagedModel, refuse_tied, split_model


if TYPE_CHECKING:
    from pipetrain.pb.journal import StudyJournal

__all__ = ["StudyConfig", "RunSpec", "RunResult", "StudyResult", "plan_runs", "run_study", "is_diverged",
           "runs_per_engine", "CURVE_POINTS"]

#: points of each run's training-loss curve (means over equal shares of its samples)
CURVE_POINTS = 40


@dataclass(frozen=True)
class StudyConfig:
    """What to train. ``lr``/``momentum``/``weight_decay`` are the reference batch's settings."""

    model: str = "resmlp"
    data: str = "digits"
    test_data: str | None = None
    stages: tuple[int, ...] = (4, 8, 16)
    methods: tuple[Method, ...] = ()
    seeds: tuple[int, ...] = (0, 1)
    epochs: float = 5.0
    reference_batch: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_scales: tuple[float, ...] = (1.0,)
    delay_scales: tuple[float, ...] = (1.0,)
    decay_fraction: float = 0.2
    dtype: str = "float32"
    max_runs: int = 0  # runs per engine; 0: by stage count (runs_per_engine)
    workers: int = 1  # processes training engines in parallel

    def __post_init__(self) -> None:
        if not self.methods:
            raise ConfigError("give at least one method (e.g. sgd,pb,pb+sc,pb+lwp,pb+sc+lwp)")
        if any(s < 1 for s in self.stages):
            raise ConfigError(f"{option('stages')} must be positive integers, got {list(self.stages)}")
        if not self.stages and any(m.pipelined for m in self.methods):
            raise ConfigError(f"PB methods need {option('stages')} (e.g. {option('stages', (4, 8, 16))})")
        if not self.seeds:
            raise ConfigError(f"{option('seeds')} must hold at least one seed")
        if not self.epochs > 0:
            raise ConfigError(f"{option('epochs')} must be positive, got {self.epochs}")
        if any(not s > 0 for s in self.lr_scales):
            raise ConfigError(f"{option('lr_scales')} values must be positive, got {list(self.lr_scales)}")
        if any(s < 0 for s in self.delay_scales) or not self.delay_scales:
            raise ConfigError(f"{option('delay_scales')} values must be >= 0, got {list(self.delay_scales)}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"{option('decay_fraction')} must lie in [0, 1], got {self.decay_fraction}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"{option('dtype')} must be float32 or float64, got {self.dtype!r}")
        if self.max_runs < 0:
            raise ConfigError(f"{option('max_runs')} must be >= 0 (0: automatic), got {self.max_runs}")
        if self.workers < 1:
            raise ConfigError(f"{option('workers')} must be >= 1, got {self.workers}")
        translate_hyperparameters(self.reference_batch, self.lr, self.momentum, self.weight_decay)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32


# the flags of `pipetrain pb` that are not the StudyConfig field's name; test_data is named under a key
# of its own, study_test_data, since TrainConfig's test_data is the keyword eval_data
name_options({"lr_scales": "--lr-scale", "delay_scales": "--delay-scale", "study_test_data": "--test-data"},
             {"study_test_data": "test_data"})


@dataclass(frozen=True)
class RunSpec:
    """One training run. ``stages`` and ``delay_scale`` are None where they do not apply."""

    method: Method
    stages: int | None
    lr_scale: float
    delay_scale: float | None
    seed: int

    @property
    def pipeline_stages(self) -> int:
        return self.stages if self.method.pipelined and self.stages else 1

    @property
    def key(self) -> tuple:
        """The run's identity in a study journal (:func:`run_key`)."""
        return run_key(self.method.name, self.stages, self.lr_scale, self.delay_scale, self.seed)


def run_key(method: str, stages: int | None, lr_scale: float, delay_scale: float | None, seed: int) -> tuple:
    """One run of a study, as a value equal for a planned run and its recorded result."""
    return (method, stages, float(lr_scale), None if delay_scale is None else float(delay_scale), int(seed))


@dataclass
class RunResult:
    """What one run achieved. ``curve``: the online training loss (each sample's loss at its
    forward) averaged over :data:`CURVE_POINTS` equal shares of the run's samples."""

    method: str
    stages: int | None
    lr_scale: float
    delay_scale: float | None
    seed: int
    lr: float
    momentum: float
    batch_size: int
    samples: int
    test_accuracy: float
    test_loss: float
    train_accuracy: float
    final_train_loss: float
    diverged: bool
    seconds: float
    engine: str
    curve: list[float] = field(default_factory=list)

    def row(self, *, curve: bool = False) -> dict[str, Any]:
        """A JSON-ready dictionary (NaN and infinity become None)."""
        data = asdict(self)
        if not curve:
            data.pop("curve")
        return {k: _finite(v) for k, v in data.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass
class StudyResult:
    config: StudyConfig
    runs: list[RunResult]
    hyperparameters: dict[str, Any]
    seconds: float
    train_samples: int
    test_samples: int


def is_diverged(final_train_loss: float, finite_weights: bool, num_classes: int,
                reference_loss: float | None = None) -> bool:
    """Did a run diverge (blow up, or lose most of what it learned)?

    Yes if its weights or final training loss are not finite, or if the final training loss is
    above ln(C)/2 (half the loss of guessing uniformly among C classes): normalised models such as
    resmlp rarely reach NaN, an unstable run gets stuck near chance instead. ``reference_loss`` is
    the final training loss of batch-size-1 SGD with the same seed and lr scale, when the study has
    it: the threshold is then at least 10 times that, so that a setting too short for anything to
    train well (SGD ends high too) is not called diverged.
    """
    if not finite_weights or not math.isfinite(final_train_loss):
        return True
    threshold = 0.5 * math.log(num_classes)
    if reference_loss is not None and math.isfinite(reference_loss):
        threshold = max(threshold, 10.0 * reference_loss)
    return final_train_loss > threshold


def _mark_divergence(runs: list["RunResult"], num_classes: int) -> None:
    """Set ``diverged`` of every run, against the paired batch-1 SGD run where there is one."""
    sgd = {(r.seed, r.lr_scale): r.final_train_loss for r in runs if r.method == "sgd"}
    for run in runs:
        finite = math.isfinite(run.final_train_loss)
        run.diverged = is_diverged(run.final_train_loss, finite, num_classes, sgd.get((run.seed, run.lr_scale)))


#: a reference whose mean test accuracy stays within this much of chance (0.10: ten points) did not train
UNTRAINED_MARGIN = 0.10


def reference_untrained(runs: list[RunResult], num_classes: int) -> list[dict[str, Any]]:
    """The lr scales at which the study's reference did not train: batch-B SGD (``sgd-batch``), or
    batch-1 SGD without it, at a mean test accuracy (a fraction, as in :class:`RunResult`) within
    :data:`UNTRAINED_MARGIN` of chance (1/C). A comparison of PB methods against an untrained reference says nothing
    about PB: the tables say so instead (a network the defaults do not suit, say)."""
    chance = 1.0 / num_classes
    for name in ("sgd-batch", "sgd"):
        reference = [r for r in runs if r.method == name]
        if reference:
            break
    else:
        return []
    found = []
    for lr_scale in sorted({r.lr_scale for r in reference}):
        accuracies = [r.test_accuracy for r in reference if r.lr_scale == lr_scale]
        mean = sum(accuracies) / len(accuracies) if all(math.isfinite(a) for a in accuracies) else math.nan
        if not mean > chance + UNTRAINED_MARGIN:
            found.append({"method": name, "lr_scale": lr_scale, "test_accuracy": _finite(mean), "chance": chance})
    return found


def untrained_text(entry: dict[str, Any]) -> str:
    """One warning line for an entry of :func:`reference_untrained`."""
    accuracy = "not finite" if entry["test_accuracy"] is None else f"{100 * entry['test_accuracy']:.1f} %"
    return (f"WARNING: the reference ({entry['method']}) did not train at lr scale {entry['lr_scale']:g}: test "
            f"accuracy {accuracy}, chance {100 * entry['chance']:.1f} %; the methods below are compared untrained. "
            "Tune the reference first (pipetrain pb --methods sgd-batch with other --lr, --momentum, --epochs)")


def plan_runs(config: StudyConfig) -> list[RunSpec]:
    """Every run of the study: non-pipelined methods once per lr scale and seed, PB methods per
    stage count too, compensated PB methods per delay scale too."""
    runs: list[RunSpec] = []
    for method in config.methods:
        stage_list: Sequence[int | None] = config.stages if method.pipelined else [None]
        delays: Sequence[float | None] = config.delay_scales if method.compensated else [None]
        for stages in stage_list:
            for lr_scale in config.lr_scales:
                for delay_scale in delays:
                    for seed in config.seeds:
                        runs.append(RunSpec(method, stages, lr_scale, delay_scale, seed))
    return runs


def _load_data(config: StudyConfig) -> tuple[Dataset, Dataset]:
    if config.test_data:
        return load_dataset(config.data), load_dataset(config.test_data)
    train, test = load_train_test(config.data)
    if test is None:
        raise ConfigError(
            f"pipetrain pb measures test accuracy, but {config.data!r} has no test split (its factory has no "
            f"split= parameter): give {option('study_test_data')} SPEC"
        )
    return train, test


def _tensors(dataset: Dataset, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = get_batch(dataset, torch.arange(len(dataset)))  # type: ignore[arg-type]
    return x.to(dtype), y


def _check_model(config: StudyConfig, info) -> int:
    """Build the model once: BatchNorm and stage counts fail here, before any training."""
    model = build_model(config.model, input_shape=info.input_shape, num_classes=info.num_classes, seed=0)
    refuse_batchnorm(model)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"model {config.model!r} is a {type(model).__name__}, not an nn.Sequential of pipeline "
            "units; return a list of units (or an nn.Sequential) from your factory so it can be cut "
            "into stages"
        )
    units = len(model)
    pipelined = any(m.pipelined for m in config.methods)
    too_many = [s for s in config.stages if s > units] if pipelined else []
    if too_many:
        raise ConfigError(
            f"{option('stages', too_many)}: model {config.model!r} has only {units} "
            f"top-level units (blocks), and each stage needs at least one; keep {option('stages')} at {units} "
            f"or fewer, or use a deeper model (e.g. resmlp:depth={max(too_many) - 2} has {max(too_many)} units)"
        )
    return units


def _index_stream(num_samples: int, batch: int, seed: int, updates: int) -> torch.Tensor:
    """``[updates, batch]`` sample indices: ``BatchSampler(batch, seed)``'s updates 0, 1, ..."""
    sampler = BatchSampler(num_samples, batch, seed=seed)
    epochs = math.ceil(updates * batch / num_samples) + 1
    flat = torch.cat([sampler.epoch_order(e) for e in range(epochs)])
    return flat[: updates * batch].view(updates, batch)


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    was = model.training
    model.eval()
    total, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(x), 2048):
            out = model(x[start : start + 2048])
            total += float(nn.functional.cross_entropy(out, y[start : start + 2048], reduction="sum"))
            correct += int((out.argmax(-1) == y[start : start + 2048]).sum())
    model.train(was)
    return total / len(x), correct / len(x)


class _Trainer:
    """Builds models, optimizers and data streams for batches of runs and trains them."""

    def __init__(self, config: StudyConfig, progress: Callable[[int], None] | None):
        self.config = config
        self.progress = progress
        self.dtype = config.torch_dtype
        self.train_set, self.test_set = _load_data(config)
        self.info = dataset_info(self.train_set)
        if self.info.num_classes is None:
            raise ConfigError(
                "pipetrain pb studies classifiers (test accuracy, cross entropy at batch size 1): the data's targets "
                "must be integer class labels"
            )
        self.units = _check_model(config, self.info)
        self.x, self.y = _tensors(self.train_set, self.dtype)
        self.x_test, self.y_test = _tensors(self.test_set, self.dtype)
        self.n = len(self.x)
        self.translated = translate_hyperparameters(
            config.reference_batch, config.lr, config.momentum, config.weight_decay
        )

    def settings(self, spec: RunSpec) -> tuple[int, float, float]:
        """(batch size, lr, momentum) of a run."""
        if spec.method.batch:
            return self.config.reference_batch, self.config.lr * spec.lr_scale, self.config.momentum
        return 1, self.translated.lr * spec.lr_scale, self.translated.momentum

    def updates(self, batch: int) -> int:
        return BatchSampler(self.n, batch).steps_for_epochs(self.config.epochs)

    def _build(self, spec: RunSpec) -> tuple[nn.Module, StagedModel, list]:
        model = build_model(
            self.config.model, input_shape=self.info.input_shape, num_classes=self.info.num_classes, seed=spec.seed
        ).to(self.dtype)
        staged = split_model(model, stages=spec.pipeline_stages)
        refuse_tied(staged.tied, "Pipelined Backpropagation updates every stage at its own time, from stale gradients")
        return model, staged, self.optimizers(spec)

    def optimizers(self, spec: RunSpec) -> list:
        """The run's stage optimizers: the translated SGD with the method's compensation per stage."""
        batch, lr, momentum = self.settings(spec)
        delays = pb_delays(spec.pipeline_stages)
        method = spec.method
        scale = 1.0 if spec.delay_scale is None else spec.delay_scale
        samples = self.updates(batch) * batch
        schedule = EndDecayLR(total=samples, fraction=self.config.decay_fraction) if self.config.decay_fraction > 0 else None
        return build_stage_optimizers(
            f"sgd:lr={lr!r},momentum={momentum!r},weight_decay={self.config.weight_decay!r}",
            delays,
            compensation=method.compensation,
            sc_delays=[method.sc * scale * d for d in delays] if method.sc else None,
            lwp_horizons=[method.lwp * scale * d for d in delays] if method.lwp else None,
            lr_schedule=schedule,
        )

    def engine_key(self, spec: RunSpec) -> tuple:
        """Runs with equal keys may share an engine: the same stage count and batch size, and the
        same optimizer and momentum on every stage (which) or not (DTS): the engine's float32
        arithmetic depends on that alone (:class:`~pipetrain.pb.engine.BatchedPB`), so a run gives
        the same bits whatever runs it trains beside."""
        momenta = {(type(o).__name__, getattr(o, "momentum", None)) for o in self.optimizers(spec)}
        return spec.pipeline_stages, self.settings(spec)[0], momenta.pop() if len(momenta) == 1 else "varied"

    def train(self, specs: list[RunSpec]) -> list[RunResult]:
        """Train runs of one :meth:`engine_key` together (one engine)."""
        batch = self.settings(specs[0])[0]
        updates = self.updates(batch)
        built = [self._build(spec) for spec in specs]
        streams = torch.stack([_index_stream(self.n, batch, spec.seed, updates) for spec in specs], 1)
        start = time.perf_counter()
        try:
            engine = BatchedPB(
                [b[1].stages for b in built], [b[2] for b in built], sample_shape=self.info.input_shape,
                batch_size=batch, dtype=self.dtype,
            )
        except NotBatchable:
            engine = None
        if engine is not None:
            progress = None if self.progress is None else (lambda k: self.progress(k * len(specs)))  # type: ignore[misc]
            losses = engine.train(self.x, self.y, streams, progress=progress)
            engine.write_back()
            kind = "batched"
        else:
            losses = torch.empty((updates, len(specs)), dtype=torch.float64)
            for r, (model, staged, optimizers) in enumerate(built):
                samples = [(self.x[idx], self.y[idx]) for idx in streams[:, r]]
                result = pb_sequential(staged.stages, optimizers, samples)
                losses[:, r] = torch.tensor(result.losses, dtype=torch.float64)
                model.load_state_dict(staged.merge_state_dict(result.params))
                if self.progress is not None:
                    self.progress(updates)
            kind = "reference"
        seconds = (time.perf_counter() - start) / len(specs)
        return [self._result(spec, model, losses[:, r], batch, updates, seconds, kind)
                for r, (spec, (model, _, _)) in enumerate(zip(specs, built))]

    def _result(self, spec, model, losses, batch, updates, seconds, kind) -> RunResult:
        _, lr, momentum = self.settings(spec)
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        train_loss, train_acc = _evaluate(model, self.x, self.y) if finite else (math.nan, 0.0)
        test_loss, test_acc = _evaluate(model, self.x_test, self.y_test) if finite else (math.nan, 0.0)
        values = losses.to(torch.float64).numpy()
        bins = min(updates, CURVE_POINTS)
        edges = np.linspace(0, updates, bins + 1).astype(int)
        curve = [float(values[a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]
        return RunResult(
            method=spec.method.name, stages=spec.stages, lr_scale=spec.lr_scale,
            delay_scale=spec.delay_scale, seed=spec.seed, lr=lr, momentum=momentum, batch_size=batch,
            samples=updates * batch, test_accuracy=test_acc, test_loss=test_loss,
            train_accuracy=train_acc, final_train_loss=train_loss,
            diverged=not finite, seconds=seconds,  # decided against the paired SGD run later
            engine=kind, curve=curve,
        )


def runs_per_engine(stages: int, limit: int) -> int:
    """How many runs train together: ``limit`` if set (> 0), else more for short pipelines.

    A tick of S stages costs Python overhead per unit position (a 4-stage pipeline of a 32-unit
    model has 8 positions, a 32-stage one 1) plus memory traffic per run (every weight is read
    and written once per sample). Short pipelines gain from stacking many runs, long ones from
    keeping a few runs' weights in cache: 16 runs for S <= 4, 8 for S = 8, 4 from S = 16.
    """
    if limit > 0:
        return limit
    return max(4, min(16, 64 // max(stages, 1)))


def _chunks(config: StudyConfig, trainer: "_Trainer", specs: list[RunSpec]) -> list[list[RunSpec]]:
    """The runs of each engine, the most expensive engines first."""
    batches: dict[tuple, list[RunSpec]] = {}
    for spec in specs:
        batches.setdefault(trainer.engine_key(spec), []).append(spec)
    chunks = []
    for (stages, *_), group in batches.items():
        limit = runs_per_engine(stages, config.max_runs)
        chunks += [group[first : first + limit] for first in range(0, len(group), limit)]

    def cost(chunk: list[RunSpec]) -> float:
        batch = trainer.settings(chunk[0])[0]
        positions = math.ceil(trainer.units / chunk[0].pipeline_stages)
        return trainer.updates(batch) * (positions + len(chunk))

    return sorted(chunks, key=cost, reverse=True)


_WORKER_TRAINER: dict[StudyConfig, "_Trainer"] = {}


def _train_in_worker(config: StudyConfig, chunk: list[RunSpec], queue: Any) -> list[RunResult]:
    """Train one engine's runs in a worker process; progress goes through ``queue``."""
    torch.set_num_threads(1)
    trainer = _WORKER_TRAINER.get(config)
    if trainer is None:
        trainer = _WORKER_TRAINER[config] = _Trainer(config, None)
    trainer.progress = queue.put
    return trainer.train(chunk)


def _train_parallel(config, chunks, progress, finished) -> list[tuple[RunSpec, RunResult]]:
    context = multiprocessing.get_context("spawn")
    pairs: list[tuple[RunSpec, RunResult]] = []
    with context.Manager() as manager, ProcessPoolExecutor(config.workers, mp_context=context) as pool:
        messages = manager.Queue()
        pending = {pool.submit(_train_in_worker, config, chunk, messages): chunk for chunk in chunks}
        while pending:
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            while True:
                try:
                    count = messages.get_nowait()
                except queue_module.Empty:
                    break
                if progress is not None:
                    progress(count)
            for future in done:
                chunk = pending.pop(future)
                results = future.result()
                finished(results)
                pairs += list(zip(chunk, results))
    return pairs


def run_study(
    config: StudyConfig,
    *,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    journal: StudyJournal | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> StudyResult:
    """Train every run of ``config``. ``on_start(total_samples)`` is called once before training,
    ``progress(samples)`` as run-samples complete (for a progress bar). With ``config.workers``
    > 1 the engines train in that many processes (one thread each). ``journal``
    (:class:`~pipetrain.pb.journal.StudyJournal`): the runs it holds are not trained again, and
    every engine's runs are recorded in it as they finish; ``on_resume(held, total)`` is told how
    many runs it held."""
    start = time.perf_counter()
    trainer = _Trainer(config, progress)
    specs = plan_runs(config)
    held = journal.done() if journal is not None else {}
    results: dict[RunSpec, RunResult] = {s: held[s.key] for s in specs if s.key in held}
    if on_resume is not None and journal is not None:
        on_resume(len(results), len(specs))
    todo = [s for s in specs if s not in results]
    if on_start is not None:
        on_start(sum(trainer.updates(trainer.settings(s)[0]) * trainer.settings(s)[0] for s in todo))
    chunks = _chunks(config, trainer, todo)
    finished = journal.record if journal is not None else (lambda runs: None)
    if config.workers > 1 and len(chunks) > 1:
        results.update(_train_parallel(config, chunks, progress, finished))
    else:
        for chunk in chunks:
            trained = trainer.train(chunk)
            finished(trained)
            results.update(zip(chunk, trained))
    ordered = [results[s] for s in specs]
    _mark_divergence(ordered, trainer.info.num_classes)
    untrained = reference_untrained(ordered, trainer.info.num_classes)
    t = trainer.translated
    hyper = {
        "reference": {"batch_size": config.reference_batch, "lr": config.lr, "momentum": config.momentum,
                      "weight_decay": config.weight_decay},
        "translated": {"batch_size": 1, "lr": t.lr, "momentum": t.momentum, "weight_decay": t.weight_decay},
        "units": trainer.units,
        "num_classes": trainer.info.num_classes,
        "epochs": config.epochs,
        "decay_fraction": config.decay_fraction,
        "untrained_reference": untrained,
    }
    return StudyResult(config, ordered, hyper, time.perf_counter() - start, len(trainer.x), len(trainer.x_test))
