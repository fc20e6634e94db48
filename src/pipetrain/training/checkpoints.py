"""Where a distributed run checkpoints, and where it starts from: a named checkpoint, the newest
complete one of ``--checkpoint-dir``, or afresh.

One command line serves the first start and every restart: ``--checkpoint-dir D`` alone resumes
from D's newest complete checkpoint when there is one and starts afresh otherwise, saying which;
``--resume`` insists on a checkpoint (an error when D holds none); ``--resume D/step-N`` names
one. Every rank is told the same checkpoint by rank 0 (one broadcast), so no two ranks can pick
different ones.

Checkpoints are taken after every ``--checkpoint-every`` updates (default
:data:`DEFAULT_CHECKPOINTS` per run) and after the last update, at a consistent cut of the
programs (:mod:`pipetrain.schedule.cuts`); the newest ``--keep`` (default :data:`DEFAULT_KEEP`)
complete ones are kept.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch.distributed as dist

from pipetrain.errors import ConfigError, PipetrainError, option, written
from pipetrain.runtime.checkpoint import (Checkpoint, check_step_dir, find_latest, open_checkpoint, prune, resolve,
                                          save_distributed)
from pipetrain.runtime.errors import PeerLostError
from pipetrain.runtime.lock import DirectoryLock
from pipetrain.runtime.status import env_store
from pipetrain.schedule.cuts import split_counts
from pipetrain.training.config import TrainConfig
from pipetrain.training.outputs import say
from pipetrain.training.recut import layout_of, rank_file, recut_needed, recut_state
from pipetrain.training.run import Run

__all__ = ["Checkpoints", "Resumed", "DEFAULT_KEEP", "DEFAULT_CHECKPOINTS", "checkpoint_period", "rank_file", "chain",
           "claim_directory", "resumed_checkpoint"]

#: Complete checkpoints kept by default (``--keep``).
DEFAULT_KEEP = 2
#: Without ``--checkpoint-every``, a run with ``--checkpoint-dir`` checkpoints about this many times.
DEFAULT_CHECKPOINTS = 10

_runs = itertools.count()  # runs of this process: every rank counts the same runs in the same order


def checkpoint_period(run: Run) -> int:
    """The updates between two checkpoints: ``--checkpoint-every``, or by default a tenth of the run
    (:data:`DEFAULT_CHECKPOINTS`), moved up to the next period whose pauses do not split an update
    that the replicas of a stage make together. 0 without ``--checkpoint-dir``."""
    config = run.config
    if not config.checkpoint_dir:
        return 0
    if config.checkpoint_every:
        return config.checkpoint_every
    period = max(1, math.ceil(run.updates / DEFAULT_CHECKPOINTS))
    if any(len(ranks) > 1 for ranks in run.schedule.stage_ranks):
        units = run.layout.units_per_update
        split = split_counts(run.schedule)
        while period < run.updates and any(step * units in split for step in range(period, run.updates, period)):
            period += 1
    return period


def claim_directory(config: TrainConfig, run: str | None = None) -> DirectoryLock | None:
    """Take the lock of ``--checkpoint-dir`` for this run (:mod:`pipetrain.runtime.lock`), or
    refuse with one line naming the run that holds it; None without a checkpoint directory.
    ``run``: the run's identity (default: this process's, see
    :func:`~pipetrain.runtime.lock.run_identity`). Says so when it takes over a stale lock."""
    if not config.checkpoint_dir:
        return None
    lock = DirectoryLock(config.checkpoint_dir, run)
    note = lock.acquire()
    if note and not config.quiet:
        say(note)
    return lock


class Resumed:
    """The checkpoint a run starts from: its step, its cut, this rank's state and where it is."""

    def __init__(self, step: int, cut, state, path: str) -> None:
        self.step, self.cut, self.state, self.path = step, cut, state, path


class Checkpoints:
    """Where this rank checkpoints (its cut after every :func:`checkpoint_period` updates and
    after the last) and what the run resumes from (see the module docstring)."""

    def __init__(self, run, rank: int, world_size: int, callbacks: Any = None) -> None:
        self.run, self.rank, self.world_size, self.callbacks = run, rank, world_size, callbacks
        config = run.config
        self.directory = config.checkpoint_dir  # its options were checked with the rest (training.validate)
        self.every = checkpoint_period(run)
        self.keep = config.keep
        self.serial = next(_runs)
        self._store = None
        self._lock = None  # rank 0's hold of the directory, when no launcher holds it for the run
        # what a resumed run must agree on, one key per option, so that a refusal names each difference
        self.meta = {**config.fingerprint(), "schedule": run.schedule.name, "workers": world_size}
        if run.stage_costs:  # cut by measured time: a resumed run cuts by the same times
            self.meta["stage_costs"] = run.stage_costs
        if run.drains:  # an extended run's (--extend): where its pipeline drained, checked apart
            self.meta["drains"] = list(run.drains)
        self.layout = layout_of(run)  # what another cut needs to resume a synchronous run (training.recut)

    # -- where the run starts ----------------------------------------------------------------------

    def resume_point(self, restart: int = 0) -> Resumed | None:
        """The checkpoint this run continues from, or None to start afresh; rank 0 chooses and
        says which, every rank loads its own file of it. ``restart``: how many times the workers
        were started again (a restart without checkpoints trains again from the start)."""
        named = self.run.config.resume
        if not named and not self.directory:
            if restart and self.rank == 0:
                self._say(written(f"restart {restart} without {option('checkpoint_dir')}: training again from step 0"))
            return None
        path = self._claim_and_choose() if self.rank == 0 else None
        if self.world_size > 1:
            path = _broadcast(path)
        if isinstance(path, BaseException):
            raise path
        if path is None:
            return None
        checkpoint = open_checkpoint(path, verify=False)  # rank 0 verified it; load verifies this rank's file again
        if recut_needed(checkpoint.meta, self.meta, _compared(self.meta), self.run, where=f"checkpoint {checkpoint.path}"):
            state = recut_state(checkpoint, self.run, self.rank)  # a synchronous run on another cut
        else:
            state = checkpoint.load(rank_file(self.rank))  # tensors and plain data only (weights_only=True)
        return Resumed(checkpoint.step, self.run.cut_after(checkpoint.step), state, str(checkpoint.path))

    def check(self) -> None:
        """Refuse now, before any worker starts, a resume that every worker would refuse: a named
        checkpoint that is missing or damaged, one written by a different run, one past this
        run's end (the workers choose again when they start: after a restart, a newer one); and
        a symbolic link where the run would write a checkpoint."""
        path = self._choose(say=False)
        if isinstance(path, BaseException):
            raise path
        after = 0
        if path is not None:
            checkpoint = open_checkpoint(path, verify=False)
            recut_needed(checkpoint.meta, self.meta, _compared(self.meta), self.run, where=f"checkpoint {checkpoint.path}")
            after = checkpoint.step
        for step in self.steps(after):  # a linked step directory would be refused when saved: refused now
            check_step_dir(self.directory, step)

    def close(self) -> None:
        """Give back the directory's lock, if this rank took it (at the end of the run)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _claim_and_choose(self) -> str | None | BaseException:
        """Rank 0: the directory's lock first (a second run is refused before it reads anything),
        then :meth:`_choose`."""
        try:
            self._lock = claim_directory(self.run.config)
        except PipetrainError as error:
            return error
        return self._choose()

    def _choose(self, say: bool = True) -> str | None | BaseException:
        """Rank 0: the path of the checkpoint to resume (None: afresh), or the error that refuses
        the resume (handed to every rank); ``say``: print which."""
        tell = self._say if say else (lambda text: None)
        if not self.run.config.resume and not self.directory:
            return None
        config, run = self.run.config, self.run
        try:
            skipped: list[str] = []
            if isinstance(config.resume, str):
                checkpoint = resolve(config.resume)
            elif config.resume:
                checkpoint = resolve(self.directory)
            else:  # --checkpoint-dir alone: the newest complete checkpoint, if any
                checkpoint = find_latest(self.directory, skipped=skipped)
                if checkpoint is None:
                    tell(f"no checkpoint in {self.directory}: starting afresh"
                         + "".join(f"; skipped {reason}" for reason in skipped))
                    return None
            if checkpoint.step > run.updates:
                raise ConfigError(
                    f"checkpoint {checkpoint.path} is at step {checkpoint.step}, past the end of this run "
                    f"({run.updates} steps): resume with {option('steps', checkpoint.step)} or more, or start "
                    f"afresh with another {option('checkpoint_dir')}"
                )
            self._check_drains(checkpoint)
            where = "the end" if checkpoint.step == run.updates else f"step {checkpoint.step} of {run.updates}"
            tell(f"resuming from {where} ({checkpoint.path})" + "".join(f"; skipped {r}" for r in skipped))
            return str(checkpoint.path)
        except PipetrainError as error:
            return error

    def _check_drains(self, checkpoint) -> None:
        """Refuse a checkpoint whose run drained its pipeline elsewhere than this one does: one of a
        run extended with --extend resumed without it, or, with it, one of a longer run."""
        config, run = self.run.config, self.run
        drained = [int(d) for d in checkpoint.meta.get("drains", [])]
        old = int(checkpoint.meta.get("updates", checkpoint.step))
        if config.extend and old > run.updates:
            raise ConfigError(
                f"{option('extend')} continues a run for more updates, and checkpoint {checkpoint.path} is of a run "
                f"of {old} updates, more than this one's {run.updates}: give {option('steps', old)} or more"
            )
        if drained and not config.extend and list(run.drains) != drained:
            raise ConfigError(
                f"checkpoint {checkpoint.path} is of a run extended with {option('extend')} (its pipeline drained "
                f"after update {', '.join(map(str, drained))}): to resume it, turn on {option('extend')} too"
            )
        expected = drained + ([old] if config.extend and old < run.updates else [])
        if config.extend and list(run.drains) != expected and run.schedule.is_asynchronous():
            raise ConfigError(
                f"checkpoint {checkpoint.path} drains its pipeline after updates {expected}, where this run drains "
                f"after {list(run.drains)}: it changed while the run started; start it again"
            )

    def _say(self, text: str) -> None:
        if not self.run.config.quiet:
            say(text)

    # -- where the run checkpoints -------------------------------------------------------------

    def steps(self, after: int) -> list[int]:
        """The steps after ``after`` at whose cut a checkpoint is taken (the last step included)."""
        if not self.every:
            return []
        updates = self.run.updates
        return [step for step in [*range(self.every, updates, self.every), updates] if step > after]

    def hooks(self, runner, after: int) -> dict[int, Any]:
        """``{program position: save}`` for this rank's checkpoints after step ``after``."""
        hooks: dict[int, Any] = {}
        for step in self.steps(after):
            position = self.run.cut_after(step).positions[self.rank]
            previous = hooks.get(position)
            save = self._saver(runner, step)
            hooks[position] = save if previous is None else chain(previous, save)
        return hooks

    def _saver(self, runner, step: int):
        def save() -> None:
            if self._store is None:  # one store client for the whole run
                self._store = env_store(self.run.config.timeout)
            path = save_distributed(
                self.directory, step, {rank_file(self.rank): runner.snapshot()},
                dict(self.meta, updates=self.run.updates, layout=self.layout), rank=self.rank, world_size=self.world_size,
                store=self._store, timeout=self.run.config.timeout, key=f"{self.serial}/{step}",
                liveness=getattr(runner, "liveness", None),  # a long save is not a silence
            )
            if self.callbacks is not None:
                self.callbacks.checkpoint(step, str(path))
            if self.rank == 0:
                prune(self.directory, keep=self.keep)

        return save


def _compared(meta: dict) -> list[str]:
    """The keys of a run's metadata that a checkpoint must equal (its drains are checked apart:
    the checkpoint an extended run continues from has none)."""
    return [key for key in meta if key != "drains"]


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PeerLostError(f"choosing the checkpoint to resume failed because a peer is gone or stuck ({first})") from None
    return box[0]


def chain(first, second):
    """One hook that runs ``first``, then ``second`` (an evaluation and a checkpoint at one cut)."""

    def call() -> None:
        first()
        second()

    return call


def resumed_checkpoint(config: TrainConfig) -> Checkpoint | None:
    """The checkpoint the run will resume (None: afresh, or none usable), read before the run is
    built: the named checkpoint, or the newest one in ``--checkpoint-dir`` (which a run with that
    option alone resumes). The runtime chooses again, and reports, when it resumes."""
    if not config.resume and not config.checkpoint_dir:
        return None
    try:
        if isinstance(config.resume, str):
            return resolve(config.resume)
        if config.resume:
            return resolve(config.checkpoint_dir or "")
        return find_latest(config.checkpoint_dir, verify=False, skipped=[])  # the runtime warns
    except Exception:  # noqa: BLE001 - no usable checkpoint: the runtime reports it when it resumes
        return None
