"""The GPU check of issue 16: one command, one table, for one machine with a CUDA GPU.

Prepared and dry-run on the CPU (``--device cpu --quick``, where every "GPU" figure is the CPU's
and proves only that the script runs); its figures count only from a run with ``--device cuda``.
Rows:

* ``emulator cuda = cpu``: every schedule on the emulator, on the GPU against the CPU, same seed
  and data. Not bitwise: cuBLAS and the CPU's kernels sum in different orders, so the parameters
  agree to float32 rounding grown over the steps; the row passes within ``--tolerance`` (relative
  to the largest parameter, 1e-3 by default: a few steps of SGD amplify 1e-7 rounding by a few
  hundred at most on these small models).
* ``runtime 2 ranks on 1 GPU = emulator``: the distributed runtime with two worker processes that
  share the one GPU (messages through the gloo transport's host buffers) against the emulator on
  the GPU: bitwise expected, as on the CPU (same kernels, same order), and reported either way.
* ``bf16 trains``: a GPT under ``--precision bf16``: the mean loss of the last five updates
  against the first five.
* ``recompute = none``: ``--recompute stage`` against none on the GPU, a GPT with dropout:
  parameters (bitwise expected) and the peak memory of stage 0 (``torch.cuda.max_memory_allocated``).
* ``samples/s``: each schedule on the emulator for a GPT large enough to be compute-bound
  (12 layers, width 768 by default) against plain single-device training of the same model and
  batch in the same script (the emulator runs every stage on the one GPU, so the ratio is the
  pipeline's overhead, not a speed-up).

Usage::

    python benchmarks/gpu_check.py [--device cuda] [--quick] [--tolerance 1e-3] [--steps 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from pipetrain.training import TrainConfig  # noqa: E402
from pipetrain.training.train import train  # noqa: E402

SCHEDULES = {
    "gpipe": dict(stages=2, microbatches=4), "1f1b": dict(stages=2, microbatches=4),
    "interleaved": dict(stages=2, chunks=2, microbatches=4), "zb-h1": dict(stages=2, microbatches=4),
    "pipedream": dict(stages=2), "2bw": dict(stages=2, microbatches=4),
    "pb": dict(stages=2, batch_size=1),
}


def _state(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu")


def _difference(a: dict, b: dict) -> tuple[float, bool]:
    """Largest absolute difference relative to the largest parameter, and whether bitwise equal."""
    scale = max(float(t.abs().max()) for t in a.values() if t.is_floating_point() and t.numel())
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    return worst / scale, all(torch.equal(a[k], b[k]) for k in a)


def _trained(config: TrainConfig, path: str) -> dict:
    result = train(dataclasses.replace(config, save=path))
    return {"state": _state(path), "result": result}


def parity_rows(args, base: TrainConfig, directory: str) -> list[tuple[str, str, bool]]:
    rows = []
    for name, options in SCHEDULES.items():
        config = dataclasses.replace(base, schedule=name, **options)
        if name == "pb":
            config = dataclasses.replace(config, steps=config.steps * 8)
        here = _trained(dataclasses.replace(config, device=args.device), os.path.join(directory, f"{name}-dev.pt"))
        cpu = _trained(dataclasses.replace(config, device="cpu"), os.path.join(directory, f"{name}-cpu.pt"))
        worst, bitwise = _difference(here["state"], cpu["state"])
        rows.append((f"emulator {args.device} = cpu: {name}", f"max rel diff {worst:.2e}"
                     + (" (bitwise)" if bitwise else ""), worst <= args.tolerance))
    return rows


def runtime_row(args, base: TrainConfig, directory: str) -> list[tuple[str, str, bool]]:
    from pipetrain.runtime.launch import launch

    rows = []
    configs = [dataclasses.replace(base, schedule=name, executor="distributed", device=args.device,
                                   save=os.path.join(directory, f"{name}-runtime.pt"), **SCHEDULES[name])
               for name in ("1f1b", "pipedream")]
    result = launch(_run_all, (configs,), nprocs=2, timeout=600, quiet=True)
    if result.returncode != 0:
        return [("runtime 2 ranks on 1 device", f"failed: {result.message}", False)]
    for config in configs:
        emulated = _trained(dataclasses.replace(config, executor="emulate", save=None),
                            config.save.replace("runtime", "emulated"))
        worst, bitwise = _difference(_state(config.save), emulated["state"])
        rows.append((f"runtime 2 ranks on 1 {args.device} = emulator: {config.schedule}",
                     "bitwise" if bitwise else f"max rel diff {worst:.2e}", worst <= args.tolerance))
    return rows


def _run_all(configs):
    from pipetrain.training.distributed import worker

    for config in configs:
        worker(config)


def bf16_row(args, base: TrainConfig, directory: str) -> list[tuple[str, str, bool]]:
    config = dataclasses.replace(base, schedule="1f1b", stages=2, microbatches=4, precision="bf16", device=args.device,
                                 steps=max(base.steps, 20), optimizer="adam:lr=0.002")
    losses = _trained(config, os.path.join(directory, "bf16.pt"))["result"].update_losses
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    return [("bf16 trains (1f1b)", f"loss {first:.3f} -> {last:.3f}", last < first)]


def recompute_row(args, base: TrainConfig, directory: str) -> list[tuple[str, str, bool]]:
    outcome = {}
    for mode in ("none", "stage"):
        config = dataclasses.replace(base, model=base.model + ",dropout=0.1", schedule="gpipe", stages=2,
                                     microbatches=4, recompute=mode, device=args.device)
        outcome[mode] = _trained(config, os.path.join(directory, f"recompute-{mode}.pt"))
    worst, bitwise = _difference(outcome["none"]["state"], outcome["stage"]["state"])
    peak = {mode: outcome[mode]["result"].extra["memory"]["stages"][0]["peak_bytes"] for mode in outcome}
    text = ("bitwise" if bitwise else f"max rel diff {worst:.2e}") + \
        f"; stage 0 peak {peak['stage'] / 2**20:.0f} MiB against {peak['none'] / 2**20:.0f} MiB"
    if args.device == "cpu":  # one process's lifetime peak RSS, reached by whichever ran first: no comparison
        return [("recompute = none (gpipe)", text + " (CPU: not comparable)", worst <= args.tolerance)]
    return [("recompute = none (gpipe)", text, worst <= args.tolerance and peak["stage"] < peak["none"])]


def plain_rate(config: TrainConfig, device: torch.device, steps: int, warmup: int) -> float:
    """Samples/s of plain training of the same model and batches on one device."""
    from pipetrain.data import BatchSampler, get_batch
    from pipetrain.training.parts import parts_from_config

    parts = parts_from_config(config)
    model, loss_fn = parts.model.to(device).train(), parts.loss_fn
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    sampler = BatchSampler(parts.train_set, config.batch_size, seed=config.seed, shuffle=True)
    started = None
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(device)
            started = time.perf_counter()
        x, y = get_batch(parts.train_set, sampler.indices(step))
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    _synchronize(device)
    return steps * config.batch_size / (time.perf_counter() - started)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed_rows(args, directory: str) -> list[tuple[str, str, bool]]:
    from pipetrain.execution.device import resolve_device

    device = resolve_device(args.device)
    config = TrainConfig(model=args.big_model, data=f"text:block_size={args.block}", batch_size=args.big_batch,
                         steps=args.speed_steps, optimizer="adam:lr=0.001", executor="emulate", device=args.device,
                         progress=False, quiet=True, seed=0)
    plain = plain_rate(config, device, args.speed_steps, warmup=3)
    rows = [("samples/s plain training", f"{plain:.0f}", True)]
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw"):
        options = dict(SCHEDULES[name], microbatches=SCHEDULES[name].get("microbatches", 1) * 2)
        if name == "pipedream":
            options["microbatches"] = 1
        result = train(dataclasses.replace(config, schedule=name, **options))
        rate = result.extra.get("steady_samples_per_s") or result.samples_per_s
        rows.append((f"samples/s {name} (emulator, every stage on the one device)",
                     f"{rate:.0f} ({rate / plain:.2f}x plain)", True))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny models (a dry run of the script)")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.big_model = "gpt:n_layer=2,n_embd=32,n_head=2" if args.quick else "gpt:n_layer=12,n_embd=768,n_head=12"
    args.block = 16 if args.quick else 256
    args.big_batch = 8 if args.quick else 16
    args.speed_steps = 3 if args.quick else 12
    torch.manual_seed(0)
    started = time.perf_counter()
    machine = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    # no dropout where the CPU and the GPU are compared: their random generators differ
    base = TrainConfig(model="gpt:n_layer=2,n_head=2,n_embd=32", data="text:block_size=16,min_length=4",
                       batch_size=8, steps=args.steps, optimizer="sgd:lr=0.05,momentum=0.9", executor="emulate",
                       progress=False, quiet=True, timeout=120.0)
    rows: list[tuple[str, str, bool]] = []
    with tempfile.TemporaryDirectory() as directory:
        for part in (parity_rows, runtime_row, bf16_row, recompute_row):
            rows += part(args, base, directory)
            print(f"  ... {rows[-1][0]}: {rows[-1][1]} ({time.perf_counter() - started:.0f} s)", flush=True)
        rows += speed_rows(args, directory)
    width = max(len(r[0]) for r in rows)
    print(f"\nGPU check on {machine} (torch {torch.__version__}), {time.perf_counter() - started:.0f} s")
    print(f"{'check':<{width}}  {'result':<56} ok")
    for check, result, ok in rows:
        print(f"{check:<{width}}  {result:<56} {'yes' if ok else 'NO'}")
    return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
