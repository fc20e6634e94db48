"""Training throughput of a 2-stage pipeline on CPU: the baselines pipetrain's runtime must beat.

Model: an MLP of 8 hidden Linear+ReLU layers and a Linear head to 10 classes, split 2 ways (the
first 4 hidden layers on stage 0, the rest and the head on stage 1); SGD lr 0.01, cross-entropy,
one optimizer step per batch (gradients of the microbatches accumulated, each microbatch's loss
divided by their number, as torch.distributed.pipelining's ``scale_grads`` does).

Configurations:

* ``compute-bound``  width 1024, batch 1024 in 8 microbatches of 128;
* ``overhead-bound`` width 256, batch 1024 in 32 microbatches of 32.

Contenders (each a function ``(config, steps, warmup) -> samples/s``, run in fresh processes
pinned one core and one thread each by pipetrain's launcher):

* ``sequential``            one process trains the whole model, microbatch by microbatch: rate R;
* ``sequential-pair``       two such processes at once, one per core, their rates summed: what two
                            cores of the machine deliver together (2R on truly independent cores);
* ``torch ScheduleGPipe``   torch.distributed.pipelining, 2 processes, gloo;
* ``torch Schedule1F1B``    the same with 1F1B;
* ``hand loop on Messenger``  a hand-written 2-stage training loop (gpipe or 1f1b order) over
                            pipetrain's ``Messenger``: no executor, no schedule IR; a check that
                            the transport itself is lean, and a target for the runtime.
* ``loop-1f1b-on-demand``   torch.distributed.pipelining's 1F1B order and waits, hand-written over
                            the ``Messenger``; ``loop-1f1b-executors`` the same loop computing
                            through pipetrain's ``StageExecutor``: with ``pipetrain-1f1b`` they
                            split the runtime's time into transport, stage arithmetic and the rest;
                            ``loop-1f1b-updating`` also updates the weights as the runtime does
                            (``StageExecutor.step`` after each batch), ``loop-1f1b-labels`` sends
                            the labels in the activations' message, as the runtime does.

Each is printed as samples/s and as a ratio to R, to 2R (two stages without bubbles) and to
2R*m/(m+1) (the bound of a flushing 2-stage schedule with m microbatches). pipetrain's runtime
schedules are added as more entries of ``CONTENDERS`` (see the end of this file).

Usage::

    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py [--configs compute-bound,overhead-bound]
        [--contenders sequential,torch-gpipe,torch-1f1b,loop-gpipe,loop-1f1b] [--repeats 2]
        [--steps N] [--warmup N] [--reference torch-1f1b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pipetrain.runtime.launch import init_distributed, launch

__all__ = ["Config", "CONFIGS", "CONTENDERS", "build_model", "split_model", "make_batch", "pipetrain_config",
           "pipetrain_rate"]


@dataclass(frozen=True)
class Config:
    width: int
    batch: int
    microbatches: int
    steps: int  # timed optimizer steps (overridable with --steps)
    warmup: int = 2
    classes: int = 10
    hidden: int = 8
    lr: float = 0.01

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


CONFIGS = {
    "compute-bound": Config(width=1024, batch=1024, microbatches=8, steps=4, warmup=1),
    "overhead-bound": Config(width=256, batch=1024, microbatches=32, steps=20, warmup=3),
}


def build_model(cfg: Config, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(cfg.hidden):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    layers.append(nn.Linear(cfg.width, cfg.classes))
    return nn.Sequential(*layers)


def split_model(model: nn.Sequential, cfg: Config, first: int | None = None) -> tuple[nn.Sequential, nn.Sequential]:
    """Stage 0: the first half of the hidden layers (or the first ``first``); stage 1: the rest
    and the head."""
    cut = 2 * (cfg.hidden // 2 if first is None else first)  # each hidden layer is 2 modules (Linear, ReLU)
    return nn.Sequential(*model[:cut]), nn.Sequential(*model[cut:])


def make_batch(cfg: Config, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.batch, cfg.width, generator=g), torch.randint(0, cfg.classes, (cfg.batch,), generator=g)


def pipetrain_model(width: int, hidden: int, classes: int) -> nn.Sequential:
    """:func:`build_model` as a pipetrain model factory, so pipetrain trains the very weights the
    other contenders train (``--model benchmarks.vs_torch_pipelining:pipetrain_model:...``)."""
    return build_model(Config(width=width, batch=1, microbatches=1, steps=1, warmup=0, classes=classes, hidden=hidden))


def pipetrain_data(width: int, batch: int, classes: int, split: str = "train") -> TensorDataset:
    """:func:`make_batch` as a pipetrain data factory: the batch every other contender trains on
    (the held-out split is its first 64 samples; the benchmark evaluates nothing)."""
    x, y = make_batch(Config(width=width, batch=batch, microbatches=1, steps=1, warmup=0, classes=classes))
    return TensorDataset(x, y) if split == "train" else TensorDataset(x[:64], y[:64])


def _timed(step: Callable[[], None], cfg: Config, steps: int, warmup: int) -> float:
    """samples/s over ``steps`` steps after ``warmup``; the slowest rank's time when distributed."""
    for _ in range(warmup):
        step()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if dist.is_initialized():
        dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return steps * cfg.batch / float(elapsed)


# -- sequential ------------------------------------------------------------------------------------


def sequential_step(cfg: Config) -> Callable[[], None]:
    """One optimizer step of plain single-process training, the rate R: forward, loss and
    backward of every microbatch (each loss divided by their number), then SGD."""
    model = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = make_batch(cfg)
    xs, ys = x.split(cfg.microbatch), y.split(cfg.microbatch)

    def step() -> None:
        for xb, yb in zip(xs, ys):
            (F.cross_entropy(model(xb), yb) / cfg.microbatches).backward()
        opt.step()
        opt.zero_grad()

    return step


def _sequential_worker(cfg: Config, steps: int, warmup: int) -> float:
    return _timed(sequential_step(cfg), cfg, steps, warmup)


def sequential(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_sequential_worker, cfg, steps, warmup, nprocs=1)


def _sequential_pair_worker(cfg: Config, steps: int, warmup: int) -> float:
    init_distributed("gloo", timeout=600)  # only for the barriers that start and stop both clocks
    return 2 * _sequential_worker(cfg, steps, warmup)


def sequential_pair(cfg: Config, steps: int, warmup: int) -> float:
    """Two independent sequential trainings at once, one per core, started and stopped together:
    the samples/s two cores of this machine really deliver. On a machine with two independent
    cores this is 2R; where the cores share a physical core's resources (as vCPUs often do) it is
    less, and no pipeline on these two cores can beat it."""
    return _run(_sequential_pair_worker, cfg, steps, warmup)


# -- torch.distributed.pipelining ----------------------------------------------------------------


def _torch_pipelining_worker(cfg: Config, steps: int, warmup: int, schedule: str) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    env = init_distributed("gloo", timeout=600)
    stages = split_model(build_model(cfg), cfg)
    module = stages[env.rank]
    stage = PipelineStage(module, env.rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, cfg.microbatches, loss_fn=lambda out, target: F.cross_entropy(out, target))
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
    x, y = make_batch(cfg)

    def step() -> None:
        if env.rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()

    return _timed(step, cfg, steps, warmup)


def torch_gpipe(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_torch_pipelining_worker, cfg, steps, warmup, "gpipe")


def torch_1f1b(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_torch_pipelining_worker, cfg, steps, warmup, "1f1b")


# -- a hand-written 2-stage loop over pipetrain's Messenger (a check of the transport alone) --------


def _loop_stage(cfg: Config):
    """What a hand-written loop's rank needs: its stage of the model, SGD, the microbatches, and
    the activation and gradient channels to the other rank."""
    from pipetrain.runtime.p2p import ACTIVATIONS, GRADIENTS, Messenger

    env = init_distributed("gloo", timeout=600)
    module = split_model(build_model(cfg), cfg)[env.rank]
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
    x, y = make_batch(cfg)
    messenger = Messenger(timeout=600)
    peer = 1 - env.rank
    acts, grads = messenger.channel(peer, ACTIVATIONS), messenger.channel(peer, GRADIENTS)
    return env, module, opt, x.split(cfg.microbatch), y.split(cfg.microbatch), acts, grads


def _messenger_worker(cfg: Config, steps: int, warmup: int, order: str) -> float:
    """Stage 0 runs all forwards then all backwards (gpipe) or one warm-up forward then
    alternates (1f1b); stage 1 alternates forward+loss and backward. The next receive is always
    posted before computing, so communication overlaps compute. No executor, no IR: a lower bound
    of the overhead pipetrain's runtime can reach."""
    env, module, opt, xs, ys, acts, grads = _loop_stage(cfg)
    m = cfg.microbatches

    def step0() -> None:
        outs: list[torch.Tensor] = []
        sends = []
        pending = grads.irecv()

        def forward(k: int) -> None:
            out = module(xs[k])
            outs.append(out)
            sends.append(acts.isend(out, tag=k))

        def backward(k: int) -> None:
            nonlocal pending
            g = pending.wait()
            if k + 1 < m:
                pending = grads.irecv()
            outs[k].backward(g)
            outs[k] = None  # type: ignore[call-overload]

        if order == "gpipe":
            for k in range(m):
                forward(k)
            for k in range(m):
                backward(k)
        else:
            forward(0)
            for k in range(1, m):
                forward(k)
                backward(k - 1)
            backward(m - 1)
        for h in sends:
            h.wait()
        opt.step()
        opt.zero_grad()

    def step1() -> None:
        sends = []
        pending = acts.irecv()
        for k in range(m):
            xk = pending.wait()
            if k + 1 < m:
                pending = acts.irecv()
            xk.requires_grad_(True)
            (F.cross_entropy(module(xk), ys[k]) / m).backward()
            sends.append(grads.isend(xk.grad, tag=k))
        for h in sends:
            h.wait()
        opt.step()
        opt.zero_grad()

    return _timed(step0 if env.rank == 0 else step1, cfg, steps, warmup)


def messenger_gpipe(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_messenger_worker, cfg, steps, warmup, "gpipe")


def messenger_1f1b(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_messenger_worker, cfg, steps, warmup, "1f1b")


def _on_demand_worker(cfg: Config, steps: int, warmup: int, stage_code: str) -> float:
    """1F1B in torch.distributed.pipelining's order and waits, over pipetrain's ``Messenger``: each
    receive is posted when needed and waited for together with the send before it (stage 0: two
    warm-up forwards, then send F(k+1) and receive the gradient of k, backward k, forward k+2;
    stage 1: forward+loss and backward of k, then send its input gradient and receive k+1). With
    ``stage_code="executors"`` both stages compute through pipetrain's ``StageExecutor`` instead
    of the bare modules. Together with the runtime's own row this splits pipetrain's time into
    transport, stage arithmetic, and the rest of the runtime."""
    from pipetrain.execution.stage import StageExecutor
    from pipetrain.models.loss import cross_entropy
    env, module, opt, xs, ys, acts, grads = _loop_stage(cfg)
    m = cfg.microbatches
    executor = None
    labelled = stage_code == "executors-labels"  # the labels travel with the activations, as in the runtime
    if stage_code in ("executors", "executors-updating", "executors-labels"):
        optimizer = None
        if stage_code == "executors-updating":  # SGD as the runtime builds it, one update per batch
            from pipetrain.optim import build_stage_optimizer

            optimizer = build_stage_optimizer(f"sgd:lr={cfg.lr}")
        executor = StageExecutor(env.rank, module, optimizer, loss_fn=cross_entropy if env.rank == 1 else None)
    unit = [0]  # the executor's microbatch numbers run on across steps

    def forward0(k: int, outs: dict) -> torch.Tensor:
        if executor is None:
            outs[k] = module(xs[k])
            return outs[k].detach()
        out = executor.forward(unit[0] + k, executor.versions.current, xs[k], samples=cfg.microbatch)[0]
        return (out, ys[k]) if labelled else out

    def backward0(k: int, grad: torch.Tensor, outs: dict) -> None:
        if executor is None:
            outs.pop(k).backward(grad)
        else:
            executor.backward(unit[0] + k, executor.versions.current, (grad,))

    def step0() -> None:
        outs: dict[int, torch.Tensor] = {}
        first = acts.isend(forward0(0, outs), tag=0)
        ready = forward0(1, outs)
        first.wait()
        for k in range(m):
            send = acts.isend(ready, tag=k + 1) if ready is not None else None
            grad = grads.irecv().wait()
            if send is not None:
                send.wait()
            backward0(k, grad, outs)
            ready = forward0(k + 2, outs) if k + 2 < m else None
        finish()

    def step1() -> None:
        inputs = acts.irecv().wait()
        for k in range(m):
            target = ys[k]
            if labelled:
                inputs, target = inputs
            if executor is None:
                inputs.requires_grad_(True)
                (F.cross_entropy(module(inputs), ys[k]) / m).backward()
                grad = inputs.grad
            else:
                version = executor.versions.current
                executor.forward(unit[0] + k, version, inputs, target=target, loss_scale=1 / m, samples=cfg.microbatch)
                (grad,) = executor.backward(unit[0] + k, version, None)
            send = grads.isend(grad, tag=k)
            if k + 1 < m:
                inputs = acts.irecv().wait()
            send.wait()
        finish()

    def finish() -> None:
        if executor is None:
            opt.step()
            opt.zero_grad()
        elif executor.optimizer is not None:  # the runtime's update: a new version, in place
            executor.step([executor.versions.current])
            unit[0] += m
        else:  # no optimizer: drop the sums (the update is not what is timed)
            executor.grads = None
            unit[0] += m

    return _timed(step0 if env.rank == 0 else step1, cfg, steps, warmup)


def on_demand_modules(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_on_demand_worker, cfg, steps, warmup, "modules")


def on_demand_executors(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_on_demand_worker, cfg, steps, warmup, "executors")


def on_demand_executors_updating(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_on_demand_worker, cfg, steps, warmup, "executors-updating")


def on_demand_executors_labels(cfg: Config, steps: int, warmup: int) -> float:
    return _run(_on_demand_worker, cfg, steps, warmup, "executors-labels")


def _run(worker: Callable[..., object], *args: object, nprocs: int = 2, convert: Callable = float):
    """``worker(*args)`` in ``nprocs`` pinned one-thread processes; rank 0's result through ``convert``."""
    result = launch(worker, args, nprocs, threads_per_worker=1, timeout=900, grace=2.0)
    if result.returncode != 0:
        raise SystemExit(f"{worker.__name__} failed: {result.message}")
    return convert(result.results[0])


#: name -> (label, function). pipetrain's runtime adds e.g. "pipetrain-1f1b" here.
# -- pipetrain's runtime ---------------------------------------------------------------------------


def pipetrain_config(cfg: Config, steps: int, warmup: int, schedule: str, receives: str = "auto",
                     on_nonfinite: str = "stop", **overrides):
    """The `pipetrain train --executor distributed` configuration of this benchmark: the same model,
    split and optimizer as the other contenders. PipeDream updates after every minibatch of the
    microbatch size (its unit), the flushing schedules after each batch. ``overrides`` replace
    fields (``data=`` another data spec, for example: benchmarks/data_path.py)."""
    from pipetrain.training import TrainConfig

    per_batch = cfg.microbatches if schedule == "pipedream" else 1
    options = dict(
        model=f"benchmarks.vs_torch_pipelining:pipetrain_model:width={cfg.width},hidden={cfg.hidden},"
        f"classes={cfg.classes}",
        data=f"benchmarks.vs_torch_pipelining:pipetrain_data:width={cfg.width},batch={cfg.batch},"
        f"classes={cfg.classes}",
        schedule=schedule,
        balance=[2 * (cfg.hidden // 2), 2 * (cfg.hidden - cfg.hidden // 2) + 1],  # Linear and ReLU are modules
        batch_size=cfg.microbatch if schedule == "pipedream" else cfg.batch,
        microbatches=1 if schedule == "pipedream" else cfg.microbatches,
        steps=(warmup + steps) * per_batch,
        optimizer=f"sgd:lr={cfg.lr}",
        executor="distributed",
        shuffle=False,
        progress=False,
        quiet=True,
        eval_samples=0,
        timeout=600.0,
        receives=receives,
        on_nonfinite=on_nonfinite,
    )
    options.update(overrides)
    return TrainConfig(**options)


def pipetrain_rate(config, cfg: Config, warmup: int) -> float:
    """Train ``config`` (from :func:`pipetrain_config`); samples/s from the last stage's update
    times after the warm-up updates."""
    from pipetrain.training.distributed import train_distributed

    per_batch = cfg.microbatches if config.schedule == "pipedream" else 1
    result = train_distributed(config)
    times = result.extra["update_seconds"]
    skip = max(warmup * per_batch, 1)
    return (len(times) - skip) * config.batch_size / (times[-1] - times[skip - 1])


def _pipetrain(cfg: Config, steps: int, warmup: int, schedule: str, receives: str = "auto",
               on_nonfinite: str = "stop") -> float:
    """`pipetrain train --executor distributed` on the same model, split and optimizer; the rate is
    taken from the last stage's update times after the warm-up updates."""
    return pipetrain_rate(pipetrain_config(cfg, steps, warmup, schedule, receives, on_nonfinite), cfg, warmup)


def pipetrain_gpipe(cfg: Config, steps: int, warmup: int) -> float:
    return _pipetrain(cfg, steps, warmup, "gpipe")


def pipetrain_1f1b(cfg: Config, steps: int, warmup: int) -> float:
    return _pipetrain(cfg, steps, warmup, "1f1b")


def pipetrain_1f1b_ahead(cfg: Config, steps: int, warmup: int) -> float:
    """1F1B with every channel's next receive posted ahead (the runtime's previous transfer mode)."""
    return _pipetrain(cfg, steps, warmup, "1f1b", receives="ahead")


def pipetrain_pipedream(cfg: Config, steps: int, warmup: int) -> float:
    return _pipetrain(cfg, steps, warmup, "pipedream")


def pipetrain_pipedream_unchecked(cfg: Config, steps: int, warmup: int) -> float:
    """PipeDream without the tests for NaN and infinite losses and gradients (``on_nonfinite="off"``):
    against ``pipetrain-pipedream``, what those tests cost where updates are most frequent."""
    return _pipetrain(cfg, steps, warmup, "pipedream", on_nonfinite="off")


def pipetrain_2bw(cfg: Config, steps: int, warmup: int) -> float:
    """PipeDream-2BW: one update per batch of ``cfg.microbatches`` microbatches, as 1F1B, but no
    flush (two weight versions, gradients one update stale)."""
    return _pipetrain(cfg, steps, warmup, "2bw")


CONTENDERS: dict[str, tuple[str, Callable[[Config, int, int], float]]] = {
    "sequential": ("sequential (1 process)", sequential),
    "sequential-pair": ("2 sequential at once (sum)", sequential_pair),
    "torch-gpipe": ("torch ScheduleGPipe", torch_gpipe),
    "torch-1f1b": ("torch Schedule1F1B", torch_1f1b),
    "loop-gpipe": ("hand loop on Messenger, gpipe", messenger_gpipe),
    "loop-1f1b": ("hand loop on Messenger, 1f1b", messenger_1f1b),
    "loop-1f1b-on-demand": ("torch's 1F1B loop on Messenger", on_demand_modules),
    "loop-1f1b-executors": ("  same, StageExecutor stages", on_demand_executors),
    "loop-1f1b-updating": ("  same, with the runtime's update", on_demand_executors_updating),
    "loop-1f1b-labels": ("  same, labels sent with the activations", on_demand_executors_labels),
    "pipetrain-gpipe": ("pipetrain gpipe", pipetrain_gpipe),
    "pipetrain-1f1b": ("pipetrain 1f1b", pipetrain_1f1b),
    "pipetrain-1f1b-ahead": ("pipetrain 1f1b, receives ahead", pipetrain_1f1b_ahead),
    "pipetrain-pipedream": ("pipetrain pipedream (limit 2R)", pipetrain_pipedream),
    "pipetrain-2bw": ("pipetrain 2bw", pipetrain_2bw),
    "pipetrain-pipedream-unchecked": ("  same, no non-finite tests", pipetrain_pipedream_unchecked),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each contender; ratios use the best, the median is shown beside it")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: per config)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: per config)")
    parser.add_argument("--reference", default="torch-1f1b",
                        help="contender every other is compared with round by round (when it runs)")
    args = parser.parse_args()
    names = args.contenders.split(",")
    if "sequential" not in names:
        names.insert(0, "sequential")
    print(f"machine: {os.cpu_count()} CPUs; every process pinned to its own core, 1 thread")
    for config_name in args.configs.split(","):
        cfg = CONFIGS[config_name]
        steps = args.steps or cfg.steps
        warmup = cfg.warmup if args.warmup is None else args.warmup
        m = cfg.microbatches
        print(
            f"\n{config_name}: width {cfg.width}, batch {cfg.batch} = {m} x {cfg.microbatch}, "
            f"{steps} timed steps after {warmup}, best of {args.repeats} rounds (every contender once per round)"
        )
        # Round robin: each repeat runs every contender once, so that the machine's drift over
        # minutes (large on shared vCPUs) spreads over all contenders instead of favouring some.
        # Odd rounds run the contenders in reverse order, so that a drift within a round does not
        # always favour the same neighbour.
        rates: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.repeats):
            for name in names if round_ % 2 == 0 else names[::-1]:
                rates[name].append(CONTENDERS[name][1](cfg, steps, warmup))
        r = max(rates["sequential"])
        bound = 2 * r * m / (m + 1)
        reference = rates.get(args.reference)
        print(
            f"  {'contender':30s} {'samples/s':>10s} {'median':>8s} {'x R':>6s} {'/ 2R':>6s} {'/ 2Rm/(m+1)':>12s}"
            + (f" {'/ ref':>6s} {'ahead':>6s}" if reference else "") + "   runs"
        )
        for name in names:
            best = max(rates[name])
            runs = ", ".join(f"{v:.0f}" for v in rates[name])
            versus = ""
            if reference:
                ratios = [mine / theirs for mine, theirs in zip(rates[name], reference)]
                versus = f" {statistics.median(ratios):6.2f} {sum(x > 1 for x in ratios):>3d}/{len(ratios):<2d}"
            print(
                f"  {CONTENDERS[name][0]:30s} {best:10.0f} {statistics.median(rates[name]):8.0f} {best / r:6.2f} "
                f"{best / (2 * r):6.2f} {best / bound:12.2f}{versus}   {runs}"
            )
        if reference:
            print(
                f"  / ref: median over the rounds of the ratio to {CONTENDERS[args.reference][0]} in the same round "
                "(neighbouring runs share the machine's state of the minute); ahead: rounds it was faster"
            )


if __name__ == "__main__":
    main()
