"""Outputs every executor writes the same way: held-out batches, the saved model, progress."""

from __future__ import annotations

import contextlib
import os
import time
from array import array
from typing import Any

import torch

from pipetrain.data import data_seed, get_batch, seeded
from pipetrain.errors import PipetrainError, option
from pipetrain.paths import is_safetensors_file
from pipetrain.runtime.checkpoint import CheckpointError, open_checkpoint, save_torch_file, step_dir
from pipetrain.structure import cast_floating
from pipetrain.training.run import Run
from pipetrain.weights import (INDEX, commit_shards, discard_shards, model_config_json, shard_name, write_index,
                               write_shard)

__all__ = ["HeldOut", "eval_batches", "save_state_dict", "Progress", "UpdateLosses", "say", "describe_run",
           "evaluation_line", "metrics_text", "weight_writers", "rank_weights", "write_rank_shard", "commit_rank_shard",
           "discard_rank_shard", "write_weights_index", "save_weights_here", "weights_kept"]


class HeldOut:
    """Held-out data in fixed batches (no shuffling), in the run's dtype, read on demand: every
    rank knows how many there are, only the rank that holds stage 0 reads them. From a map-style
    data set (``size`` samples a batch, the first ``total``), or a list of ``(x, y)`` batches."""

    def __init__(self, dataset: Any, size: int, dtype: torch.dtype, total: int | None = None, seed: int = 0) -> None:
        self.dataset = dataset
        self.dtype = dtype
        self.size = size
        self.seed = seed  # batch i is read under data_seed(seed, i, stream=2): a held-out set that augments reads alike everywhere
        self.batches = list(dataset) if isinstance(dataset, (list, tuple)) else None
        self.total = 0 if dataset is None else len(dataset)
        if total is not None:
            self.total = min(self.total, total)

    @classmethod
    def of(cls, data: Any, size: int, dtype: torch.dtype) -> "HeldOut":
        return cls(data, size, dtype)

    def __len__(self) -> int:
        return self.total if self.batches is not None else -(-self.total // self.size)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if self.batches is not None:
            x, y = self.batches[index]
        else:
            start = index * self.size
            with seeded(data_seed(self.seed, index, stream=2)):
                x, y = get_batch(self.dataset, torch.arange(start, min(start + self.size, self.total)))
        return cast_floating(x, self.dtype), y


def eval_batches(run: Run, batch_size: int | None = None) -> HeldOut:
    """The run's held-out set (``--eval-samples`` of it) in batches of at least 64 samples."""
    return HeldOut(run.test_set, batch_size or max(run.layout.batch_size, 64), run.dtype, run.config.eval_samples,
                   seed=run.config.seed)


def save_state_dict(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save`` (a ``.safetensors`` path: safetensors, each tensor several names share
    stored once, under its first, as ``save_pretrained`` does) to a temporary name, then rename: a
    crash never leaves a half-written file, and a failed write (a full disk) leaves no temporary
    and raises its ``OSError``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if is_safetensors_file(path):
        write_shard(os.path.dirname(os.path.abspath(path)), os.path.basename(path), state)
        return
    cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}  # loads on any machine
    save_torch_file(path, cpu, hashing=False)


def weight_writers(run: Run) -> list[int]:
    """The ranks that write a shard of ``--save DIR``: the first replica's rank of every stage."""
    return sorted({ranks[0] for ranks in run.schedule.stage_ranks})


def rank_weights(run: Run, rank: int, modules: Any) -> dict[str, torch.Tensor]:
    """The trained tensors ``rank`` writes under the unsplit model's names, from ``modules[stage]``
    (its stages' modules, after ``write_back``): those of the stages whose first replica it runs,
    each tensor by the lowest stage holding it (a tied one once), the model's unused tensors
    (modules ``forward`` never calls) with stage 0."""
    staged = run.staged
    writer: dict[str, int] = {}
    for stage, mapping in enumerate(staged.key_map):
        for key in mapping.values():
            writer.setdefault(key, stage)
    tensors: dict[str, torch.Tensor] = {}
    for stage in sorted(modules):
        if run.schedule.stage_ranks[stage][0] != rank:
            continue
        mapping = staged.key_map[stage]
        for key, value in modules[stage].state_dict().items():
            if writer[mapping[key]] == stage:
                tensors[mapping[key]] = value
        if stage == 0:
            tensors.update(staged.unused)
    return tensors


def write_rank_shard(run: Run, rank: int, modules: Any) -> dict[str, Any] | None:
    """``rank``'s shard of ``--save DIR`` (see :mod:`pipetrain.weights`), left under a temporary
    name until :func:`commit_rank_shard`: its record, or ``None`` for a rank that runs only further
    replicas. A write that fails (a full disk) is one line naming the file and where the trained
    weights are kept; nothing of the shard is left."""
    writers = weight_writers(run)
    if rank not in writers:
        return None
    name = shard_name(writers.index(rank), len(writers))
    try:
        return write_shard(run.config.save, name, rank_weights(run, rank, modules), commit=False)
    except OSError as error:
        raise _cannot_save(run, error, name) from None


def commit_rank_shard(run: Run, record: dict[str, Any] | None) -> None:
    """Rename ``rank``'s written shard into place: once every writer has written its own."""
    if record is not None:
        try:
            commit_shards(run.config.save, [record])
        except OSError as error:
            discard_rank_shard(run, record)
            raise _cannot_save(run, error, record["name"]) from None


def discard_rank_shard(run: Run, record: dict[str, Any] | None) -> None:
    """Remove ``rank``'s written shard: another writer failed, so this save leaves nothing."""
    discard_shards(run.config.save, [record])


def write_weights_index(run: Run, records: list[dict[str, Any] | None]) -> None:
    """The commit of ``--save DIR``: the index of every shard (and a HuggingFace model's config)."""
    written = [r for r in records if r is not None]
    try:
        write_index(run.config.save, written, model_config_json(run.model))
    except OSError as error:  # the shards without their index are no save: removed
        for record in written:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(run.config.save, record["name"]))
        raise _cannot_save(run, error, INDEX) from None


def _cannot_save(run: Run, error: OSError, name: str) -> PipetrainError:
    """``cannot write --save DIR: DIR/model-00001-of-00002.safetensors: No space left on device;
    the trained weights are kept in ...``"""
    return PipetrainError(f"cannot write {option('save', run.config.save)}: {os.path.join(run.config.save, name)}: "
                          f"{error.strerror or error}{weights_kept(run.config, run.updates)}")


def save_weights_here(run: Run, modules: Any) -> None:
    """``--save DIR`` from one process that holds every stage (the emulator): every shard written,
    then all renamed, then the index; a shard that cannot be written leaves none."""
    records: list[dict[str, Any] | None] = []
    try:
        for rank in weight_writers(run):
            records.append(write_rank_shard(run, rank, modules))
    except BaseException:
        for record in records:
            discard_rank_shard(run, record)
        raise
    for record in records:
        commit_rank_shard(run, record)
    write_weights_index(run, records)


def weights_kept(config: Any, updates: int) -> str:
    """Where the trained weights are when --save cannot be written: the run's last checkpoint
    (step ``updates``), when it has one."""
    if config.executor == "distributed" and config.checkpoint_dir:
        last = step_dir(config.checkpoint_dir, updates)
        try:
            open_checkpoint(last, verify=False)
            return (f"; the trained weights are kept in the run's last checkpoint, {last}: the same command, run "
                    f"again with space free, resumes there and writes {option('save')}")
        except CheckpointError:
            pass
    return "; the trained weights were not written anywhere else"


class UpdateLosses:
    """Collects the losses of units as the last stage computes them and turns each completed
    update's units into that update's loss (their mean losses weighted by sample share)."""

    def __init__(
        self, run: Run, progress: "Progress | None" = None, rank: int | None = None, on_update: Any = None
    ) -> None:
        self.layout = run.layout
        self.on_update = on_update  # on_update(update, loss) as each update's loss is complete
        self.units = run.layout.units_per_update
        self.progress = progress
        # on a replicated last stage a rank sees only its replica's units
        last = run.schedule.num_stages - 1
        self._mine = (lambda unit: True) if rank is None else (lambda unit: run.schedule.rank_of(last, unit) == rank)
        self.losses = array("d")  # every update's, 8 bytes each
        self._pending: dict[int, float] = {}
        self._expected: dict[int, list[int]] = {}  # first unit of an update -> its units seen here
        self._started = time.perf_counter()

    def __call__(self, unit: int, loss: float) -> None:
        self._pending[unit] = loss * self.layout.loss_scale(unit)
        first = unit // self.units * self.units
        expected = self._expected.get(first)
        if expected is None:  # once per update, not per unit
            expected = self._expected[first] = [u for u in range(first, first + self.units) if self._mine(u)]
        if all(u in self._pending for u in expected):
            del self._expected[first]
            self.losses.append(sum(self._pending.pop(u) for u in expected))
            if self.on_update is not None:
                self.on_update(first // self.units, self.losses[-1])
            if self.progress is not None:
                self.progress.update(1, self.losses[-1], self.layout.batch_size, time.perf_counter() - self._started)

    @staticmethod
    def from_units(run: Run, losses: dict[int, float]) -> array:
        """Per-update losses (an ``array('d')``) from a complete ``{unit: loss}`` record."""
        units, layout = run.layout.units_per_update, run.layout
        return array("d", (sum(losses[k] * layout.loss_scale(k) for k in range(t * units, (t + 1) * units))
                           for t in range(run.updates)))


class Progress:
    """A progress bar over updates showing the loss and samples/s (silent when disabled)."""

    def __init__(self, total: int, enabled: bool, description: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm  # imported here: only a run that shows its progress needs it

            self.bar = tqdm(total=total, desc=description, unit="step", dynamic_ncols=True, leave=True)
        self.samples = 0

    def update(self, steps: int, loss: float, samples: int, seconds: float) -> None:
        self.samples += samples
        if self.bar is not None:
            rate = self.samples / seconds if seconds > 0 else 0.0
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}", refresh=False)
            self.bar.update(steps)

    def write(self, text: str) -> None:
        """A line above the bar (or on stdout when there is none)."""
        say(text, self)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def say(text: str, progress: Progress | None = None) -> None:
    """A line for whoever watches the run, on stdout, with or without a terminal (a bar, where
    shown, stays below it)."""
    if progress is not None and progress.bar is not None:
        progress.bar.write(text)
    else:
        print(text, flush=True)


def describe_run(run: Run) -> str:
    """What is about to be trained: the schedule, its units and updates, how the stages were chosen,
    the data (how it is read, what is held out), then one line per stage: parameters, share of the
    measured time (when measured), where it starts (printed before training unless ``quiet``; the
    report holds the same as ``stage_choice`` and ``data``)."""
    schedule, layout = run.schedule, run.layout
    units = layout.units_per_update
    head = (f"{schedule.name}: {run.num_stages} stages on {schedule.num_ranks} "
            f"{'workers' if run.config.executor == 'distributed' else 'emulated ranks'}, {run.updates} updates of "
            f"{layout.batch_size} samples ({units} microbatch{'es' if units > 1 else ''} each)")
    data = f"\n{run.data_note}" if getattr(run, "data_note", "") else ""  # the samples, how read, what is held out
    if getattr(run, "schedule_choice", None) is not None:  # schedule auto: what it chose and each candidate's time
        data = f"\n{run.schedule_choice.text()}{data}"
    choice = run.stage_choice
    if choice is None or run.num_stages < 2:
        return head + data + "\n" + run.staged.summary()
    lines = choice.stage_lines()
    if run.staged.boundaries is not None:  # a traced cut: what each stage receives
        lines = [line + (f"  inputs: {', '.join(run.staged.boundaries[s - 1])}" if s else "")
                 for s, line in enumerate(lines)]
    recompute = getattr(run, "recompute", ())
    if recompute and len(lines) == run.num_stages:  # the plan's choice, or --recompute's, in plain view
        lines = [line + ("  (recomputes its activations)" if s in recompute else "") for s, line in enumerate(lines)]
    return f"{head}; {choice.heading()}{data}\n" + "\n".join(lines)


def evaluation_line(entry: dict[str, Any], updates: int) -> str:
    """``after  90 of 450 updates: test loss 0.7416, test accuracy 77.50 %``."""
    width = len(str(updates))
    return f"after {int(entry['step']):>{width}} of {updates} updates: {metrics_text(entry)}"


def metrics_text(entry: dict[str, Any]) -> str:
    """``test loss 0.7416, test accuracy 77.50 %``; the accuracy only where there is one (a
    classifier's, not a regression's)."""
    text = f"test loss {entry['loss']:.4f}"
    return text if entry.get("accuracy") is None else text + f", test accuracy {100 * entry['accuracy']:.2f} %"
