"""The zero-bubble frontier on 2 CPU workers: pipetrain's flushing schedules beside torch's.

One compute-bound GPT (token and position embedding, ``blocks`` pre-norm transformer blocks of
pipetrain's :class:`~pipetrain.models.gpt.Block`, a LayerNorm and a Linear head), one batch of
random tokens repeated every step, SGD, one optimizer step per batch of ``m`` microbatches. The
model is an ``nn.Sequential`` of ``blocks + 2`` modules, cut the same way for everyone: into 4
quarters ``[embed + blocks/4, blocks/4, blocks/4, blocks/4 + head]`` where each of the 2 workers
holds two stages, into 2 halves (the quarters paired) where each holds one.

Contenders, each in 2 fresh processes pinned one core and one thread each by pipetrain's launcher:

* ``1f1b``, ``interleaved`` (2 chunks a rank, looped), ``zb-h1``, ``zb-h2``, ``zb-v``,
  ``dualpipev``, ``zb-auto``: `pipetrain train --executor distributed` by schedule name; a name
  the installed pipetrain does not know is skipped with a note;
* ``torch-interleaved``, ``torch-zbv``, ``torch-dualpipev``: torch.distributed.pipelining's
  ScheduleInterleaved1F1B (looped placement: rank r holds stages r and r+2), ScheduleZBVZeroBubble
  and ScheduleDualPipeV (V placement: rank r holds stages r and 3-r), gloo.

Each round runs every contender once, the order reversed on odd rounds; a contender's samples/s
is the median over the rounds, its ratio to pipetrain 1f1b the median of the per-round ratios.
Beside it:

* ``sim s/upd``: the schedule's simulated makespan of one update (:func:`pipetrain.schedule.simulate`)
  under costs measured once here, per quarter stage at one thread (forward F, input-gradient
  backward B, the rest of the backward W, the SGD step); torch's rows are simulated as pipetrain's
  schedule of the same order (interleaved, zb-v, dualpipev) where the installed pipetrain has it.
  No transfer cost is charged: the gap to ``s/upd`` (measured) is communication, waits and the
  runtime's own overhead. ``sim rt``: the same with a split backward's W charged what pipetrain's
  runtime spends on it, measured here too (the costs line's "runtime's W": since issue 35 the
  weight part of the graph from the gradients the runtime's B kept, :mod:`pipetrain.execution.split_backward`;
  before, a second backward from the stage's output), against the ideal W = full backward - B of ``sim s/upd``.
* ``peak MB r0/r1``: each worker's peak RSS above its RSS when training starts (model built and
  cut), pipetrain's ``memory.stages[].peak_bytes - start_bytes``, measured the same way inside
  torch's workers; ``pred acts``: the memory report's predicted peak of microbatch activations
  held per rank (stage-microbatches; for two stages a rank, its chunks together), ``pred MB``
  that count times one stage-microbatch's saved activations (measured here) plus the rank's
  gradients.
* ``max|dp|``: the largest absolute difference of the trained parameters from pipetrain
  ``interleaved``'s (pipetrain ``1f1b``'s when interleaved did not run), after the same steps on the
  same data: every synchronous schedule trains the same numbers, up to float32 rounding.

Usage::

    PYTHONPATH=src python benchmarks/zero_bubble.py [--quick] [--rounds 4] [--steps N] [--warmup N]
        [--contenders 1f1b,interleaved,zb-h1,...,torch-interleaved,torch-zbv,torch-dualpipev]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pipetrain.execution.split_backward import input_half
from pipetrain.models.gpt import Block

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["Setup", "SETUPS", "PIPETRAIN", "TORCH", "gpt", "pipetrain_model", "pipetrain_data", "make_batch",
           "cut", "placement", "pipetrain_argv", "measure_costs", "table"]


@dataclass(frozen=True)
class Setup:
    vocab: int
    seq: int
    width: int
    heads: int
    blocks: int  # a multiple of 4: each quarter stage holds blocks/4
    batch: int
    microbatches: int
    steps: int  # timed updates
    warmup: int  # untimed updates first
    lr: float = 0.01

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


SETUPS = {
    "full": Setup(vocab=256, seq=64, width=256, heads=4, blocks=8, batch=16, microbatches=8, steps=10, warmup=2),
    "quick": Setup(vocab=32, seq=8, width=16, heads=2, blocks=4, batch=16, microbatches=8, steps=3, warmup=1),
}

#: pipetrain's schedules by name, in the table's order
PIPETRAIN = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "zb-auto")
#: torch's: contender -> (class name in torch.distributed.pipelining, placement, pipetrain's same order)
TORCH = {
    "torch-interleaved": ("ScheduleInterleaved1F1B", "loop", "interleaved"),
    "torch-zbv": ("ScheduleZBVZeroBubble", "v", "zb-v"),
    "torch-dualpipev": ("ScheduleDualPipeV", "v", "dualpipev"),
}
RANKS = 2


# -- the model and data ----------------------------------------------------------------------------


class Embed(nn.Module):
    """Token plus position embedding: ``(B, T)`` int64 ids to ``(B, T, width)``."""

    def __init__(self, vocab: int, seq: int, width: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the Linear to the vocabulary: logits ``(B, T, vocab)``."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(setup: Setup, seed: int = 0) -> nn.Sequential:
    """The benchmark's GPT, the same weights for every contender."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(setup.vocab, setup.seq, setup.width),
                         *(Block(setup.width, setup.heads) for _ in range(setup.blocks)),
                         Head(setup.width, setup.vocab))


def _setup(**fields: Any) -> Setup:
    return Setup(**{**asdict(SETUPS["quick"]), **fields})


def pipetrain_model(vocab: int, seq: int, width: int, heads: int, blocks: int) -> nn.Sequential:
    """:func:`gpt` as a pipetrain model factory (``--model benchmarks.zero_bubble:pipetrain_model:...``)."""
    return gpt(_setup(vocab=vocab, seq=seq, width=width, heads=heads, blocks=blocks))


def make_batch(setup: Setup, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every step trains on: random token ids and random next tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = (setup.batch, setup.seq)
    return torch.randint(0, setup.vocab, shape, generator=g), torch.randint(0, setup.vocab, shape, generator=g)


def pipetrain_data(vocab: int, seq: int, batch: int, split: str = "train") -> TensorDataset:
    """:func:`make_batch` as a pipetrain data factory (the held-out split is unused)."""
    x, y = make_batch(_setup(vocab=vocab, seq=seq, batch=batch))
    return TensorDataset(x, y) if split == "train" else TensorDataset(x[:4], y[:4])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over a microbatch (pipetrain's default loss does the same)."""
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def cut(setup: Setup, pieces: int) -> list[int]:
    """Modules per stage: ``pieces`` = 4 quarters or 2 halves (quarters paired)."""
    q = setup.blocks // 4
    quarters = [1 + q, q, q, q + 1]
    return quarters if pieces == 4 else [quarters[0] + quarters[1], quarters[2] + quarters[3]]


def placement(kind: str, rank: int) -> list[int]:
    """The stages (of 4) rank ``rank`` holds: looped (r, r+2) or V (r, 3-r)."""
    return [rank, rank + RANKS] if kind == "loop" else [rank, 2 * RANKS - 1 - rank]


def _stages(model: nn.Sequential, setup: Setup, pieces: int) -> list[nn.Sequential]:
    bounds, start = [], 0
    for size in cut(setup, pieces):
        bounds.append((start, start + size))
        start += size
    return [model[a:b] for a, b in bounds]


def _module_indices(setup: Setup, pieces: int, stage: int) -> range:
    sizes = cut(setup, pieces)
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


# -- pipetrain's contenders -----------------------------------------------------------------------


def known_schedules() -> tuple[str, ...]:
    from pipetrain.schedule import SCHEDULES

    return tuple(SCHEDULES)


def _schedule(name: str, microbatches: int):
    from pipetrain.schedule import build

    return build(name, RANKS, microbatches, chunks=2 if name == "interleaved" else 1)


def pipetrain_argv(name: str, setup: Setup, directory: str) -> list[str]:
    """The `pipetrain train` command of schedule ``name``: the same model, cut, data and optimizer."""
    pieces = _schedule(name, setup.microbatches).num_stages
    model = (f"benchmarks.zero_bubble:pipetrain_model:vocab={setup.vocab},seq={setup.seq},width={setup.width},"
             f"heads={setup.heads},blocks={setup.blocks}")
    data = f"benchmarks.zero_bubble:pipetrain_data:vocab={setup.vocab},seq={setup.seq},batch={setup.batch}"
    argv = ["train", "--model", model, "--data", data, "--schedule", name, "--stages", str(RANKS),
            "--balance", ",".join(map(str, cut(setup, pieces))), "--batch-size", str(setup.batch),
            "--microbatches", str(setup.microbatches), "--steps", str(setup.warmup + setup.steps),
            "--optimizer", f"sgd:lr={setup.lr}", "--executor", "distributed", "--threads-per-worker", "1",
            "--no-shuffle", "--eval-samples", "0", "--quiet", "--no-progress", "--timeout", "600",
            "--report-json", os.path.join(directory, f"{name}.json"), "--save", os.path.join(directory, f"{name}.pt")]
    if name == "interleaved":
        argv += ["--chunks", "2"]
    return argv


def _env() -> dict[str, str]:
    """The environment of `pipetrain train`: the pipetrain this process imported, and ``benchmarks``."""
    import pipetrain

    paths = [str(Path(pipetrain.__file__).resolve().parents[1]), str(ROOT),
             *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


def run_pipetrain(name: str, setup: Setup, directory: str) -> dict[str, Any]:
    """Train with schedule ``name``; samples/s from the last stage's update times after the warm-up,
    each rank's peak RSS above its start, the memory report's prediction, the trained weights."""
    argv = [sys.executable, "-m", "pipetrain.cli", *pipetrain_argv(name, setup, directory)]
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"pipetrain {name} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    with open(os.path.join(directory, f"{name}.json"), encoding="utf-8") as handle:
        report = json.load(handle)
    ends = report["update_seconds"]
    skip = max(setup.warmup, 1)
    rate = (len(ends) - skip) * setup.batch / (ends[-1] - ends[skip - 1])
    peaks, predicted = [0.0] * RANKS, [0] * RANKS
    for stage in report["memory"]["stages"]:
        for rank in stage["ranks"]:
            if stage["peak_bytes"] is not None and stage["start_bytes"] is not None:
                peaks[rank] = max(peaks[rank], stage["peak_bytes"] - stage["start_bytes"])
            predicted[rank] = max(predicted[rank], stage["predicted_peak_activations"])
    params = torch.load(os.path.join(directory, f"{name}.pt"))
    return {"rate": rate, "peaks": peaks, "predicted": predicted, "params": params}


# -- torch's contenders ----------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _torch_worker(setup: Setup, contender: str) -> dict[str, Any]:
    """One rank of torch's schedule: its two stages, SGD over them, ``warmup + steps`` steps; the
    timed steps' samples/s (the slower rank's clock), peak RSS above the start, its stages' weights."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from pipetrain.runtime.launch import init_distributed

    class_name, kind, _ = TORCH[contender]
    env = init_distributed("gloo", timeout=600)
    model = gpt(setup)
    pieces = _stages(model, setup, 4)
    local = placement(kind, env.rank)
    stages = [pipelining.PipelineStage(pieces[s], s, 4, torch.device("cpu")) for s in local]
    schedule = getattr(pipelining, class_name)(stages, setup.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for s in local for p in pieces[s].parameters()], lr=setup.lr)
    x, y = make_batch(setup)
    args = (x,) if 0 in local else ()
    kwargs = {"target": y} if 3 in local else {}

    def step() -> None:
        schedule.step(*args, **kwargs)
        optimizer.step()
        optimizer.zero_grad()

    start_rss = _rss()
    for _ in range(setup.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {i for s in local for i in _module_indices(setup, 4, s)}
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if int(k.split(".")[0]) in mine}
    return {"rate": setup.steps * setup.batch / float(elapsed), "peak": peak - start_rss, "params": params}


def run_torch(contender: str, setup: Setup) -> dict[str, Any]:
    from pipetrain.runtime.launch import launch

    result = launch(_torch_worker, (setup, contender), RANKS, threads_per_worker=1, timeout=1800, grace=2.0)
    if result.returncode != 0:
        raise RuntimeError(f"{contender} failed: {result.message}")
    ranks = result.results
    params: dict[str, torch.Tensor] = {}
    for r in ranks:
        params.update(r["params"])
    return {"rate": ranks[0]["rate"], "peaks": [r["peak"] for r in ranks], "predicted": None, "params": params}


# -- costs, simulation, memory model ---------------------------------------------------------------


def _saved_bytes(fn) -> tuple[Any, int]:
    """``fn()`` and the bytes of the distinct storages autograd saved for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def measure_costs(setup: Setup, repeats: int = 3) -> dict[str, list[float]]:
    """Per quarter stage, at one thread, medians of ``repeats``: forward ``F``, input-gradient
    backward ``B``, the rest of a full backward ``W``, the SGD ``step`` (seconds), ``Wrt``, the
    weight half as pipetrain's runtime computes it (``StageExecutor.backward_weight``: since issue 35
    from what the runtime's B kept, before it a second backward from the stage's output to the
    weights), and ``act``, the bytes one
    microbatch's saved activations take (the stage's output included)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = gpt(setup)
        quarters = _stages(model, setup, 4)
        x, y = make_batch(setup)
        x, y = x[: setup.microbatch], y[: setup.microbatch]
        bodies = [quarters[0][1:], *quarters[1:]]  # stage 0 timed from its embedding's output (a gather)
        with torch.no_grad():
            inputs = [quarters[0][0](x)]
            for body in bodies[:-1]:
                inputs.append(body(inputs[-1]))
        costs: dict[str, list[float]] = {k: [] for k in ("F", "B", "W", "Wrt", "step", "act")}
        for s, (q, body) in enumerate(zip(quarters, bodies)):
            params = list(q.parameters())
            optimizer = torch.optim.SGD(params, lr=setup.lr)
            times: dict[str, list[float]] = {k: [] for k in ("F", "full", "B", "Wrt", "step")}
            for _ in range(repeats + 1):
                for full in (True, False):
                    inp = inputs[s].clone().requires_grad_(True)
                    t0 = time.perf_counter()
                    out, act = _saved_bytes(lambda: body(inp))
                    loss = loss_fn(out, y) if s == 3 else (out * torch.ones_like(out)).sum()
                    t1 = time.perf_counter()
                    if full:
                        loss.backward()
                    else:  # the runtime's I (execution/split_backward.py), keeping what its W starts from
                        _, half = input_half([loss], None, [inp], params)
                    t2 = time.perf_counter()
                    times["F"].append(t1 - t0)
                    times["full" if full else "B"].append(t2 - t1)
                    if not full:
                        if half is not None:
                            half.run()
                        else:  # where the runtime keeps the plain path: a second backward
                            torch.autograd.backward(loss, inputs=params)
                        times["Wrt"].append(time.perf_counter() - t2)
                t3 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad()
                times["step"].append(time.perf_counter() - t3)
            median = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
            costs["F"].append(median["F"])
            costs["B"].append(min(median["B"], median["full"]))
            costs["W"].append(max(median["full"] - median["B"], 0.0))
            costs["Wrt"].append(median["Wrt"])
            costs["step"].append(median["step"])
            costs["act"].append(float(act + out.numel() * out.element_size()))
        return costs
    finally:
        torch.set_num_threads(threads)


def simulated_seconds(name: str, setup: Setup, costs: dict[str, list[float]], runtime_w: bool = False) -> float:
    """The simulated makespan of one update of pipetrain's schedule ``name`` under ``costs``; with
    ``runtime_w`` a split backward's W costs what pipetrain's runtime spends on it (``Wrt``)."""
    from pipetrain.schedule import Costs, simulate
    from pipetrain.schedule.ir import Kind

    schedule = _schedule(name, setup.microbatches)
    per = {k: v if schedule.num_stages == 4 else [v[0] + v[1], v[2] + v[3]] for k, v in costs.items()}
    split = any(action.kind is Kind.W for program in schedule.programs for action in program)
    weight = per["Wrt"] if runtime_w and split else per["W"]
    return simulate(schedule, Costs(F=per["F"], B=per["B"], W=weight, step=per["step"])).makespan


def predicted_bytes(name: str, setup: Setup, costs: dict[str, list[float]], acts: Sequence[int]) -> list[float]:
    """Per rank: the predicted activation count times one stage-microbatch's saved bytes (for two
    stages a rank, the mean of its two), plus the rank's parameters' gradients."""
    schedule = _schedule(name, setup.microbatches)
    model = gpt(setup)
    sizes = [sum(p.numel() * p.element_size() for p in q.parameters()) for q in _stages(model, setup, 4)]
    out = []
    for rank in range(RANKS):
        if schedule.num_stages == 4:
            held = sorted(schedule.rank_stages()[rank])
            act = statistics.mean(costs["act"][s] for s in held)
        else:
            held = [2 * rank, 2 * rank + 1]
            act = sum(costs["act"][s] for s in held)
        out.append(acts[rank] * act + sum(sizes[s] for s in held))
    return out


# -- the table -------------------------------------------------------------------------------------


COLUMNS = ("contender", "samples/s", "x 1f1b", "s/upd", "sim s/upd", "sim rt", "peak MB r0/r1", "pred acts",
           "pred MB r0/r1", "max|dp|")


def table(rows: list[dict[str, Any]]) -> str:
    """The results as aligned text: a header of :data:`COLUMNS` and one line per contender."""
    widths = (26, 10, 7, 8, 10, 7, 15, 10, 15, 10)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(COLUMNS), *(line(r["cells"]) for r in rows)])


def _mb(values: Sequence[float] | None) -> str:
    return "-" if not values else "/".join(f"{v / 2**20:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds, few steps (a check)")
    parser.add_argument("--contenders", default=",".join((*PIPETRAIN, *TORCH)))
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 4; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed updates (default: the setup's)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed updates first (default: the setup's)")
    args = parser.parse_args()
    setup = SETUPS["quick" if args.quick else "full"]
    overrides = {k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None}
    setup = Setup(**{**asdict(setup), **overrides})
    rounds = args.rounds or (2 if args.quick else 4)
    known = known_schedules()
    names = []
    for name in args.contenders.split(","):
        if name in TORCH:
            names.append(name)
        elif name not in known:
            print(f"note: skipping {name}: the installed pipetrain has no such schedule")
        else:
            names.append(name)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
          f"{torch.__version__}; 2 workers, each pinned to its own core, 1 thread")
    print(f"model: GPT, {setup.blocks} blocks of width {setup.width} ({setup.heads} heads), sequence {setup.seq}, "
          f"vocabulary {setup.vocab}; cut {cut(setup, 4)} modules (4 stages) or {cut(setup, 2)} (2 stages)")
    print(f"batch {setup.batch} = {setup.microbatches} x {setup.microbatch}, SGD lr {setup.lr}, {setup.steps} timed "
          f"updates after {setup.warmup}, median of {rounds} rounds (order reversed on odd rounds)")
    costs = measure_costs(setup)
    print("costs per quarter stage (ms, one microbatch, 1 thread): "
          + "; ".join(f"F {f * 1e3:.1f} B {b * 1e3:.1f} W {w * 1e3:.1f} (runtime's W {r * 1e3:.1f})"
                      for f, b, w, r in zip(costs["F"], costs["B"], costs["W"], costs["Wrt"])), flush=True)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as directory:
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                try:
                    got = run_torch(name, setup) if name in TORCH else run_pipetrain(name, setup, directory)
                except RuntimeError as error:
                    print(f"note: round {round_ + 1}: {error}", flush=True)
                    continue
                results[name].append(got)
            print(f"round {round_ + 1}/{rounds}: " + ", ".join(
                f"{n} {results[n][-1]['rate']:.1f}" for n in names if len(results[n]) == round_ + 1), flush=True)
    ran = [n for n in names if results[n]]
    reference = next((n for n in ("interleaved", "1f1b") if results.get(n)), None)
    rows = []
    for name in ran:
        runs = results[name]
        rate = statistics.median(r["rate"] for r in runs)
        if results.get("1f1b") and len(results["1f1b"]) == len(runs):
            ratio = f"{statistics.median(a['rate'] / b['rate'] for a, b in zip(runs, results['1f1b'])):.2f}"
        else:
            ratio = "-"
        same = TORCH[name][2] if name in TORCH else name
        sim = f"{simulated_seconds(same, setup, costs):.3f}" if same in known else "-"
        sim_rt = f"{simulated_seconds(same, setup, costs, runtime_w=True):.3f}" if name in known else "-"
        peaks = [statistics.median(r["peaks"][k] for r in runs) for k in range(RANKS)]
        acts = runs[-1]["predicted"]
        pred = predicted_bytes(name, setup, costs, acts) if acts else None
        if reference:
            ref = results[reference][-1]["params"]
            mine = runs[-1]["params"]
            diff = max((mine[k] - ref[k]).abs().max().item() for k in ref)
            dp = f"{diff:.1e}"
        else:
            dp = "-"
        label = f"torch {TORCH[name][0][8:]}" if name in TORCH else f"pipetrain {name}"
        rows.append({"name": name, "cells": [label, f"{rate:.1f}", ratio, f"{setup.batch / rate:.3f}", sim, sim_rt,
                                             _mb(peaks), "/".join(map(str, acts)) if acts else "-", _mb(pred), dp]})
    print()
    print(table(rows))
    if reference:
        initial = gpt(setup).state_dict()
        moved = max((results[reference][-1]["params"][k] - v).abs().max().item() for k, v in initial.items())
        print(f"max|dp| against pipetrain {reference}'s trained parameters (which moved up to {moved:.1e} from their "
              f"initial values in {setup.warmup + setup.steps} updates)")
    print("sim s/upd of torch's rows: pipetrain's schedule of the same order (interleaved, zb-v, dualpipev)")
    by = {n: [r["rate"] for r in results[n]] for n in ran}
    for a, b in (("zb-v", "1f1b"), ("zb-v", "torch-zbv")):
        if a in by and b in by and len(by[a]) == len(by[b]):
            print(f"goal: pipetrain zb-v / {b}: {statistics.median(x / y for x, y in zip(by[a], by[b])):.2f} "
                  f"(median of per-round ratios; goal {1.05 if b == '1f1b' else 1.0:.2f})")


if __name__ == "__main__":
    main()
