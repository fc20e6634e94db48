"""Training on the distributed runtime: one process per stage replica.

Started plainly, ``pipetrain train`` spawns its local workers itself (``--workers N``, one thread
each unless ``--threads-per-worker``), and a user's script run as ``python train.py`` starts
copies of itself (:func:`~pipetrain.runtime.launch.launch_script`). Started by torchrun, every
process is already a worker and reads torchrun's environment, so the same command or script runs
across machines::

    pipetrain train --model mlp --schedule pipedream --stages 2            # 2 local workers
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m pipetrain.cli train --executor distributed --stages 2 ...

Every worker prepares the same run (:func:`~pipetrain.training.setup.prepare`), builds executors
for its own stages (:class:`RankSetup`), runs its program
(:class:`~pipetrain.runtime.rank_runner.RankRunner`) and sends its results to rank 0, which writes
the outputs and reports. Where a run checkpoints and what it resumes from is
:mod:`pipetrain.training.checkpoints`'s; after a failure, ``--max-restarts N`` has the launcher
start every worker again (torchrun's own ``--max-restarts`` under torchrun), and they resume from
``--checkpoint-dir`` by themselves.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.distributed as dist

from pipetrain.errors import ConfigError, PipetrainError, option
from pipetrain.execution.losses import UnitLosses
from pipetrain.execution.timing import measured_timeline
from pipetrain.models.metrics import Metrics
from pipetrain.paths import is_weights_dir
from pipetrain.runtime.errors import collective
from pipetrain.runtime.rank_runner import RankRunner, sync_groups
from pipetrain.runtime.launch import detect, init_distributed, launch, launch_script
from pipetrain.runtime.liveness import Liveness, new_prefix
from pipetrain.runtime.lock import RUN_ID, new_run_identity
from pipetrain.runtime.p2p import Messenger
from pipetrain.runtime.share import broadcast_from, gather_to
from pipetrain.runtime.status import StatusBoard
from pipetrain.schedule.ir import Kind, halves
from pipetrain.schedule.pattern import pattern_of
from pipetrain.stages.tied import check_tied_copies
from pipetrain.training.checkpoints import Checkpoints, chain, claim_directory
from pipetrain.collector import setup_heap_frozen
from pipetrain.training.config import TrainConfig
from pipetrain.training.files import write_outputs
from pipetrain.training.memory_report import MemoryProbe, memory_report
from pipetrain.training.outputs import (Progress, UpdateLosses, commit_rank_shard, describe_run, discard_rank_shard,
                                        eval_batches, evaluation_line, say, write_rank_shard, write_weights_index)
from pipetrain.training.result import TrainResult, loss_scale_report, result_of, scale_payload
from pipetrain.training.setup import prepare

__all__ = ["train_distributed", "worker", "join", "run_worker", "spawn_script", "RankSetup", "WorkersFailed",
           "refuse_restarts_here"]


def train_distributed(config: TrainConfig) -> TrainResult | None:
    """Train the command line's configuration: as a worker if a launcher set the environment,
    else spawn the workers (each builds the run from the configuration's specs)."""
    if detect() is not None:
        refuse_restarts_here(config)
        return worker(config)
    with _directory_held(config) as env:  # one run at a time in --checkpoint-dir, every restart of this one
        run = prepare(replace(config, progress=False))  # checks the configuration before spawning
        Checkpoints(run, 0, run.schedule.num_ranks).check()  # a resume every worker would refuse: refused here
        if not config.quiet:
            say(describe_run(run))
        workers = run.schedule.num_ranks
        result = launch(worker, (config, run.stage_costs),  # the workers cut as measured here
                        nprocs=workers, threads_per_worker=config.threads_per_worker,
                        timeout=None, restarts=config.max_restarts, env=env, silence=config.timeout)
    if result.returncode != 0:
        raise WorkersFailed(result.message or f"a worker failed (exit status {result.returncode})", result.returncode)
    return result.results[0]


def spawn_script(run) -> None:
    """Start the user's script once per rank of ``run`` (already prepared here, so a bad
    configuration fails before any worker starts), wait for them, and exit with their status."""
    with _directory_held(run.config) as env:
        Checkpoints(run, 0, run.schedule.num_ranks).check()  # a resume every worker would refuse: refused here
        if not run.config.quiet:
            say(describe_run(run))
        result = launch_script(run.schedule.num_ranks, threads_per_worker=run.config.threads_per_worker,
                               restarts=run.config.max_restarts, env=env, silence=run.config.timeout)
    if result.returncode != 0 and result.message:  # a worker's own error is handed on, not printed, by it
        print(f"pipetrain: error: {result.message}", file=sys.stderr, flush=True)
    raise SystemExit(result.returncode)


@contextlib.contextmanager
def _directory_held(config: TrainConfig) -> Iterator[dict[str, str]]:
    """The launcher holds ``--checkpoint-dir``'s lock for the whole run, every restart included,
    and names the run to its workers (the environment to give them), whose rank 0 then finds
    the lock held for its own run."""
    run = new_run_identity()
    lock = claim_directory(config, run)
    try:
        yield {RUN_ID: run}
    finally:
        if lock is not None:
            lock.release()


def refuse_restarts_here(config: TrainConfig) -> None:
    """``max_restarts`` restarts the workers pipetrain starts; torchrun's are torchrun's to restart."""
    env = detect()
    if config.max_restarts and env is not None and env.launcher != "pipetrain":
        raise ConfigError(
            f"{option('max_restarts')} restarts the workers that pipetrain itself starts; under torchrun give "
            f"torchrun its own limit (torchrun's max-restarts option; a restarted run resumes from "
            f"{option('checkpoint_dir')} by itself)"
        )


class WorkersFailed(PipetrainError):
    """A worker of the run failed; ``code`` is the launcher's exit status (the command's too)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = self.exit_status = code

    def __reduce__(self):
        return (WorkersFailed, (str(self), self.code))


def worker(config: TrainConfig, stage_costs: dict[str, float] | None = None) -> TrainResult | None:
    """One worker's whole run of the command line's configuration; rank 0 returns the result.
    ``stage_costs``: the unit times the launcher measured, so that every worker cuts as it did."""
    env = join(config)
    return run_worker(prepare(config, stage_costs=stage_costs), env)


def join(config: TrainConfig):
    """Join the run's process group from the environment (torchrun's, or a pipetrain launcher's)
    and set this worker's threads; returns the :class:`~pipetrain.runtime.launch.DistEnv`."""
    env = init_distributed("gloo", timeout=config.timeout)
    if "PIPETRAIN_THREADS" not in os.environ:
        torch.set_num_threads(config.threads_per_worker)
    return env


class RankSetup:
    """What one rank of a prepared run holds: the executors of its stages, its data (where stage
    0 lives), the transport, the status board and the program runner. Shared by whole runs
    (:func:`run_worker`) and runs fed one batch at a time (:mod:`pipetrain.training.stepping`)."""

    def __init__(self, run, env, data=None, start: int = 0) -> None:
        schedule = run.schedule
        if env.world_size != schedule.num_ranks:
            raise ConfigError(
                f"{env.world_size} workers were started but the {schedule.name} schedule with "
                f"{len(run.staged.stages)} stages"
                f"{' and replicas ' + str(schedule.replicas) if any(r > 1 for r in schedule.replicas) else ''} "
                f"uses {schedule.num_ranks}; start {schedule.num_ranks} workers or change {option('stages')}/"
                f"{option('replicas')}"
            )
        self.run, self.env, self.rank = run, env, env.rank
        rank = env.rank
        self.groups = sync_groups(schedule, run.tied)
        self.held = schedule.rank_stages()[rank]
        self.executors = {stage: run.make_executor(rank, stage) for stage in self.held}
        if data is None and 0 in self.held:
            data = run.unit_data(prefetch=_updates_read(schedule, rank, run.layout))
        self.data = data if 0 in self.held else None
        self._reading = True  # until close_data
        self.status = StatusBoard.from_env()  # published until the end of the run (see close)
        self.liveness = Liveness.for_board(self.status, run.config.timeout, new_prefix())
        self._arrivals = 0
        self.messenger = Messenger(timeout=run.config.timeout, status=self.status)
        self.runner = RankRunner(schedule, rank, self.executors, self.data, run.layout, self.messenger, self.groups,
                                 self.status, start=start, receives=run.config.receives, messages=run.messages,
                                 tied=run.tied, liveness=self.liveness)

    def close_data(self) -> None:
        """Stop reading training data (its last update is read); once."""
        data, self._reading = (self.data if self._reading else None), False
        if data is not None:
            data.close()

    def close(self) -> None:
        """Stop reading data and publishing this rank's status (once). The board publishes up to here,
        through the final evaluation and the saving of the weights: a rank at long work is not silent."""
        self.close_data()
        status, self.status = self.status, None
        if status is not None:
            status.close()

    def arrive(self, what: str) -> None:
        """Every rank at ``what`` (before a collective that follows long work on some of them: an
        evaluation's last batches, the writing of a shard): waited for as long as the ranks not there
        yet are heard from (:mod:`pipetrain.runtime.liveness`), so the collective waits for no work."""
        self._arrivals += 1
        self.liveness.arrive(f"arrival{self._arrivals}", what)

    def write_back(self) -> dict[int, Any]:
        """The trained weights into the modules of this rank's first replicas; returns them by stage."""
        schedule, rank, executors = self.run.schedule, self.rank, self.executors
        firsts = {stage: executors[stage] for stage in self.held if schedule.replica_of(rank, stage) == 0}
        for executor in firsts.values():
            executor.write_back()
        return {stage: executor.module for stage, executor in firsts.items()}

    def save_weights(self) -> None:
        """``--save DIR``: every rank writes the shard of its own stages, then rank 0 the index
        (a failure on any rank stops every rank with its message)."""
        world, written = self.env.world_size, []

        def write() -> Any:
            written.append(write_rank_shard(self.run, self.rank, self.write_back()))  # under a temporary name
            return written[0]

        try:
            record = _together("saving the weights", write, world, arrive=self.arrive)
        except PipetrainError:  # a shard failed somewhere (a full disk): none is renamed into place
            discard_rank_shard(self.run, written[0] if written else None)
            raise
        records: list[Any] = [None] * world
        collective("saving the weights", lambda: dist.all_gather_object(records, record))
        _together("saving the weights", lambda: commit_rank_shard(self.run, record), world)
        _together("saving the weights", lambda: write_weights_index(self.run, records) if self.rank == 0 else None,
                  world, arrive=self.arrive)

    def payload(self, seconds: float, evaluations: list) -> dict[str, Any]:
        """This rank's results for rank 0: losses, timings, and the trained weights of its first
        replicas where rank 0 gathers them (:attr:`~pipetrain.training.run.Run.gathers_weights`)."""
        rank, executors, runner = self.rank, self.executors, self.runner
        modules = self.write_back()
        return {
            "rank": rank,
            "losses": runner.losses,
            **runner.times.payload(),  # starts and ends of its (first) actions, aggregates of a long run
            "seconds": seconds,
            "states": {stage: {k: v.cpu() for k, v in module.state_dict().items()} for stage, module in modules.items()}
            if self.run.gathers_weights else {},
            "digests": {stage: _digest(executors[stage].versions.latest) for stage in self.held},
            "evaluations": evaluations,
            "receives": "on-demand" if runner.on_demand else "ahead",
            "skipped": {stage: executors[stage].skipped for stage in self.held},  # --on-nonfinite skip
            "loss_scale": {stage: scale_payload(executors[stage]) for stage in self.held},  # --precision fp16
        }

    def gather(self, payload: dict[str, Any], resumed: int = 0) -> TrainResult:
        """Every rank's payload to rank 0, which assembles the run's result (and writes its
        outputs); every rank returns it (the others without the measured timeline). ``resumed``:
        the step the run resumed from (the updates before it were not timed here)."""
        gathered = collective("gathering the results", lambda: gather_to(payload, dst=0))
        result = _assemble(self.run, gathered, resumed) if self.rank == 0 else None
        self.arrive("rank 0's outputs")  # rank 0 writes them (a whole model, perhaps) while the others wait
        shared = collective("sharing the result",
                             lambda: broadcast_from(None if result is None else replace(result, timeline=None), src=0))
        self._release()
        return result if result is not None else replace(shared, is_main=False)

    def _release(self) -> None:
        """Drop the transport and the runner, and collect what a run leaves in reference cycles
        now, while the process group lives: left to the end of the process, torch.distributed
        objects of earlier runs destroyed during interpreter shutdown aborted a worker of a
        script that trained several times ("terminate called without an active exception")."""
        self.close()
        self.runner = self.messenger = self.liveness = None
        gc.collect()


def run_worker(run, env, callbacks: Any = None) -> TrainResult:
    """This rank's part of the whole ``run`` (see the module docstring); every rank returns the
    run's result, rank 0's with the measured timeline."""
    checkpoints = Checkpoints(run, env.rank, env.world_size, callbacks)
    try:
        return _run_rank(run, env, checkpoints, callbacks)
    finally:
        checkpoints.close()  # the directory's lock, if this rank took it


def _run_rank(run, env, checkpoints, callbacks: Any = None) -> TrainResult:
    config = run.config
    rank = env.rank
    if rank == 0 and env.launcher != "pipetrain" and not config.quiet:  # torchrun: no launcher said it

        say(describe_run(run))
    if config.resume or config.checkpoint_dir:  # each rank reads its own file: one refused, all refuse
        resumed = _together("reading the checkpoint", lambda: checkpoints.resume_point(restart=env.restart),
                            env.world_size)
    else:
        resumed = checkpoints.resume_point(restart=env.restart)
    setup = RankSetup(run, env, start=resumed.cut.positions[rank] if resumed else 0)
    runner = setup.runner
    if resumed:  # a checkpoint that does not fit this run is refused by every rank, not by one
        try:
            _together("resuming", lambda: runner.restore(resumed.state, resumed.cut), env.world_size,
                      arrive=setup.arrive)
        except BaseException:
            setup.close()
            raise
    after = resumed.step if resumed else 0
    held_out = eval_batches(run)
    evaluation_steps = [step for step in run.evaluation_steps() if step > after] if len(held_out) else []
    pause_steps = sorted(set(checkpoints.steps(after)) | set(evaluation_steps))
    pauses = [c.positions for c in run.cuts_after(pause_steps)]  # all ranks stop together there
    hooks = checkpoints.hooks(runner, after=after)
    runner.keep_for_cuts(sorted(hooks))  # the versions its checkpoints must hold
    evaluations = runner.evaluations  # restored with the rest of a resumed rank's state

    reports = rank == run.schedule.stage_ranks[-1][0]  # the last stage's: it computes the metrics

    def evaluate_at(step: int):
        def evaluate() -> None:
            metrics = runner.evaluate(len(held_out), held_out.__getitem__, Metrics(run.loss_fn))
            if metrics is not None and reports:  # (every rank has them)
                evaluations.append({"step": step, **metrics})
                if config.eval_every and not config.quiet:
                    say(evaluation_line(evaluations[-1], run.updates), progress.progress if progress else None)
                if callbacks is not None:
                    callbacks.evaluation(step, metrics)

        return evaluate

    for step in evaluation_steps:
        position = run.cut_after(step).positions[rank]
        hook = evaluate_at(step)
        # evaluate before a checkpoint of the same step, so that the checkpoint holds it
        hooks[position] = hook if position not in hooks else chain(hook, hooks[position])
    _inject_fault(rank, hooks, env.restart)
    progress = _progress(run, config, callbacks)

    probe = MemoryProbe(next(iter(setup.executors.values())).device)
    try:
        with setup_heap_frozen():
            collective("the start barrier", dist.barrier)
            started = time.perf_counter()
            try:
                runner.run(progress, origin=started, at_positions=hooks, pauses=pauses)
            finally:
                if progress is not None and progress.progress is not None:
                    progress.progress.close()
                setup.close_data()
        seconds = time.perf_counter() - started - runner.paused
        measured = probe.read()
        if len(held_out) and (not run.config.eval_every):
            evaluate_at(run.updates)()
        setup.arrive("the end of training")
        collective("the final barrier", dist.barrier)

        if config.save and is_weights_dir(config.save):
            setup.save_weights()
        return setup.gather(setup.payload(seconds, evaluations) | {"memory": measured}, resumed=after)
    finally:
        setup.close()  # the board published to the end (a failure's report reads it)


def _together(what: str, call, world_size: int, arrive=None) -> Any:
    """Run ``call`` on every rank and return its value; when it raises a PipetrainError on any of
    them, every rank raises the first (by rank) instead of leaving the others to wait for it until
    the timeout. ``arrive(what)`` (:meth:`RankSetup.arrive`), when given, waits for every rank to
    be done with ``call``, for as long as it takes them."""
    error = value = None
    try:
        value = call()
    except PipetrainError as failure:
        error = failure
    if arrive is not None:
        arrive(what)
    if world_size > 1:
        errors: list[Any] = [None] * world_size
        collective(what, lambda: dist.all_gather_object(errors, error))
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return value


def _inject_fault(rank: int, hooks: dict, restart: int = 0) -> None:
    """Testing aid: PIPETRAIN_FAULT_INJECT=RANK:POSITION kills that rank (SIGKILL) right before
    the action at POSITION of its program, a real crash at a chosen point; only in the first
    start of the workers (``restart`` 0), so that a restarted run gets past it."""
    spec = os.environ.get("PIPETRAIN_FAULT_INJECT")
    if not spec or restart:
        return
    target, _, position = spec.partition(":")
    if int(target) == rank:
        hooks[int(position)] = lambda: os.kill(os.getpid(), signal.SIGKILL)


def _progress(run, config, callbacks=None):
    """The ranks of the last stage track update losses (for callbacks); the one that computes the
    loss of unit 0 shows the progress bar."""
    last = run.num_stages - 1
    rank = _rank()
    if rank not in run.schedule.stage_ranks[last]:
        return None
    shows = config.progress and run.schedule.rank_of(last, 0) == rank
    if not shows and callbacks is None:
        return None

    bar = Progress(run.updates, shows, f"{run.schedule.name} ({run.schedule.num_ranks} workers)")
    return UpdateLosses(run, bar, rank=rank, on_update=None if callbacks is None else callbacks.update)


def _updates_read(schedule, rank: int, layout) -> list[int]:
    """The updates whose batches ``rank`` reads (its forwards of stage 0), each once, in the order
    of their first read."""
    pattern = pattern_of(schedule)
    if pattern is not None:  # a long schedule: every update or every r-th, if its sample reads them so
        sample = _updates_read(pattern.sample, rank, layout)
        per = layout.units_per_update
        step = sample[1] - sample[0] if len(sample) > 1 else 1
        if sample and step > 0 and sample == list(range(sample[0], -(-pattern.sample.total_microbatches // per), step)):
            return range(sample[0], -(-schedule.total_microbatches // per), step)  # type: ignore[return-value]
    first_reads = {
        layout.bounds(action.microbatch)[0]: None
        for whole in schedule.programs[rank]
        for action in halves(whole)
        if action.kind is Kind.F and action.stage == 0
    }
    return list(first_reads)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _digest(params) -> str:
    """A hash of a stage's parameter bytes: replicas must end bitwise identical."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    return h.hexdigest()


def _check_replicas(run, gathered: list[dict]) -> None:
    for stage, ranks in enumerate(run.schedule.stage_ranks):
        digests = {rank: gathered[rank]["digests"][stage] for rank in ranks}
        if len(set(digests.values())) > 1:
            raise PipetrainError(
                f"internal error: the replicas of stage {stage} on ranks {ranks} ended with different weights; "
                "please report this with the command that produced it"
            )


def _assemble(run, gathered: list[dict], resumed: int = 0) -> TrainResult:
    """Rank 0: the run's result from every rank's payload; writes the outputs."""
    _check_replicas(run, gathered)

    check_tied_copies(run.staged.tied, {s: state for p in gathered for s, state in p["states"].items()})

    losses = UnitLosses()
    states = {}
    for payload in gathered:
        losses.update(payload["losses"])
        states.update(payload["states"])
    if not run.on_meta:  # the unsplit model gets every stage's weights (a model built on meta holds its own)
        for stage, state in states.items():
            run.staged.stages[stage].load_state_dict(state)
    timeline = measured_timeline(run.schedule, gathered)
    seconds = max(p["seconds"] for p in gathered)
    evaluations = max((p["evaluations"] for p in gathered), key=len)
    result = result_of(run, "distributed", UpdateLosses.from_units(run, losses), seconds, timeline, evaluations,
                       resumed=resumed)
    result.extra["receives"] = [p["receives"] for p in gathered]  # per rank: when receives were posted
    skipped = {stage: steps for p in gathered for stage, steps in p["skipped"].items()}  # replicas agree
    result.extra["skipped_updates"] = [skipped[stage] for stage in range(run.num_stages)]
    if run.config.precision == "fp16":
        scales: dict[int, dict[int, Any]] = {}  # stage -> replica -> its payload
        for p in gathered:
            for stage, value in p["loss_scale"].items():
                scales.setdefault(stage, {})[run.schedule.replica_of(p["rank"], stage)] = value
        result.extra["loss_scale"] = loss_scale_report(
            [[scales[stage][r] for r in sorted(scales[stage])] for stage in range(run.num_stages)])

    if all("memory" in p for p in gathered):
        result.extra["memory"] = memory_report(run, [p["memory"] for p in gathered], per_rank=True)
    gathered_model = run.staged.merge_state_dict([states[s] for s in range(run.num_stages)]) if states else None
    write_outputs(run.config, result, run, gathered_model)
    return result
