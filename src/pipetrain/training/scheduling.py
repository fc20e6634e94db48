"""The schedule of a training run: microbatches per update (resolved and checked here, once), the
ranks, the whole run's schedule with its drains (``--extend``), and the pauses it allows.

Every count a schedule takes comes from here: :func:`resolved_microbatches` is the one place where
``--microbatches`` gets its default and its check, and :func:`run_schedule` hands the schedule
builder the run's units per update and updates, which mean the same for every schedule.
"""

from __future__ import annotations

from math import lcm

from pipetrain.errors import ConfigError, option
from pipetrain.schedule import ASYNCHRONOUS, Schedule, check
from pipetrain.schedule.cuts import split_counts
from pipetrain.schedule.drains import drained
from pipetrain.schedule.presets import LOOPED, V_SHAPED, build_updates, chunks_per_rank
from pipetrain.training.checkpoints import resumed_checkpoint
from pipetrain.training.config import TrainConfig
from pipetrain.training.options import declared_check

__all__ = ["resolved_microbatches", "stage_count", "ranks_of_balance", "run_schedule", "drains_of", "check_pauses"]


def resolved_microbatches(config: TrainConfig, name: str) -> int:
    """Microbatches per update of schedule ``name``: ``--microbatches`` (given, or a plan's), else 1
    for pipedream and pb, else up to 4; checked here, with the option's own check, for every source."""
    if config.microbatches is not None:
        units = config.microbatches
    else:
        units = 1 if name in ASYNCHRONOUS and name != "2bw" else min(4, config.batch_size)
    declared_check(TrainConfig, "microbatches")("microbatches", units)
    return units


def stage_count(config: TrainConfig, name: str, units: int) -> int:
    """The ranks of the run (stages, or the ranks a chunked schedule's stages fill), checked
    against ``--replicas`` and ``--workers``; ``units``: the microbatches per update."""
    if config.replicas:
        if config.stages is not None and config.stages != len(config.replicas):
            raise ConfigError(f"{option('replicas', config.replicas)} gives {len(config.replicas)} stages but "
                              f"{option('stages', config.stages)}")
        stages = len(config.replicas)
    elif config.stages is not None:
        stages = config.stages
    elif config.balance:
        stages = len(config.balance)
    elif config.split_at:
        stages = len(config.split_at) + 1
    else:
        stages = config.workers or 2
    chunked = name in LOOPED or name in V_SHAPED or name == "zb-auto"
    if chunked and config.balance and not config.replicas and len(config.balance) != stages * chunks_per_rank(
            name, stages, units, config.chunks):
        stages = ranks_of_balance(config, name, len(config.balance), units)  # the balance lists every chunk
    workers = (sum(config.replicas) if config.replicas else stages)
    if config.workers is not None and config.workers != workers:
        raise ConfigError(
            f"{option('workers', config.workers)} does not match the plan: {stages} stages"
            + (f" with replicas {config.replicas}" if config.replicas else "")
            + f" use {workers} workers; change {option('workers')} or {option('stages')}/{option('replicas')}"
        )
    return stages


def ranks_of_balance(config: TrainConfig, name: str, pieces: int, units: int) -> int:
    """The ranks that a cut into ``pieces`` stages fills: fewer where each rank holds several
    chunks (interleaved, the V schedules, zb-auto when it picks a V)."""
    if name == "zb-auto":
        if chunks_per_rank(name, pieces, units) == 1:
            return pieces
        if pieces % 2 == 0 and chunks_per_rank(name, pieces // 2, units) == 2:
            return pieces // 2
        raise ConfigError(f"zb-auto cannot tell from {option('balance', config.balance)} how many ranks to use; "
                          f"give {option('stages')} (ranks)")
    per_rank = chunks_per_rank(name, pieces, 1, config.chunks)
    return max(pieces // per_rank, 1)


def run_schedule(config: TrainConfig, name: str, stages: int, units: int, updates: int, policy: str | None,
                 drains: tuple[int, ...]) -> Schedule:
    """The checked schedule of the whole run: ``updates`` updates of ``units`` microbatches, drained
    after each update of ``drains``; refuses an asynchronous run whose units do not divide among
    the replicas of every stage."""
    asynchronous = name in ASYNCHRONOUS and name != "2bw"
    if asynchronous and config.replicas:
        group = lcm(*config.replicas)
        if (updates * units) % group:
            fixed = -(-updates * units // group) * group // units
            raise ConfigError(
                f"with replicas {config.replicas} the {name} units ({updates} steps x {units}) must divide evenly "
                f"among the replicas of every stage (a multiple of {group}); use {option('steps', fixed)}"
            )

    def schedule_of(count: int) -> Schedule:
        return build_updates(name, stages, units, count, chunks=config.chunks, replicas=config.replicas,
                             policy=policy, pattern=True)

    schedule = drained(schedule_of, updates, drains, units, asynchronous) if drains else schedule_of(updates)
    check(schedule)
    return schedule


def drains_of(config: TrainConfig, name: str, updates: int) -> tuple[tuple[int, ...], str]:
    """The updates after which an asynchronous run drains its pipeline (see
    :mod:`pipetrain.schedule.drains`), and what the data line says of them. With ``--extend``:
    where the run being continued drained (its checkpoint's own drains and its end, when this run
    is longer); else ``config.drain_at``."""
    if name not in ASYNCHRONOUS:
        return (), ""  # a synchronous schedule drains after every update anyway
    if not config.extend:
        return tuple(config.drain_at), ""
    checkpoint = resumed_checkpoint(config)
    if checkpoint is None:
        return (), ""
    drains = [int(d) for d in checkpoint.meta.get("drains", [])]
    old = int(checkpoint.meta.get("updates", checkpoint.step))
    if old < updates:
        drains.append(old)
    if not drains:
        return (), ""
    at = ", ".join(map(str, drains))
    return tuple(drains), (f"extends the run of {checkpoint.path}: its pipeline drained after update{'s' * (len(drains) > 1)} "
                           f"{at}, so this is not the uninterrupted {updates}-update run")


def check_pauses(config: TrainConfig, schedule: Schedule, units: int, updates: int) -> None:
    """Refuse --eval-every/--checkpoint-every values whose pauses would split an update that the
    replicas of a stage make together (asynchronous schedules with replicas)."""
    every = {"eval_every": config.eval_every, "checkpoint_every": config.checkpoint_every}
    if not any(every.values()) or all(len(ranks) < 2 for ranks in schedule.stage_ranks):
        return
    split = split_counts(schedule)

    def fits(period: int) -> bool:
        return all(step * units not in split for step in range(period, updates, period))

    for name, period in every.items():
        if period and not fits(period):
            better = next(p for p in range(period + 1, updates + 1) if fits(p))
            raise ConfigError(
                f"{option(name, period)} would pause the run in the middle of an update that the replicas of a "
                f"stage make together (replicas {list(schedule.replicas)}); use for example {option(name, better)}"
            )
