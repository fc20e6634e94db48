"""Memory per worker for a model larger than one process: the meta path against the eager path.

Trains a character GPT whose float32 weights exceed 1 GB (default: 12 layers, width 2048, the
`text` data's 96-character vocabulary: 605 M parameters, 2.42 GB) on 4 local worker processes for a
few SGD steps, twice, side by side:

* **meta**: ``--init meta`` builds the model on PyTorch's meta device on every worker; each worker
  materialises only its own stage (``reset_parameters()`` under per-module seeds), the launcher
  times the units one at a time to cut by measured time, and ``--save DIR`` writes each stage's
  shard from its own worker;
* **meta-1**: the same with one microbatch per update, where each stage applies its update during
  the backward, parameter by parameter, and so never holds its whole gradient
  (:mod:`pipetrain.execution.update_in_backward`);
* **eager**: today's path, every process builds the whole model (``--balance-by params``, so that
  the launcher does not time the whole model).

For every worker it prints its peak resident set size above that of a bare ``import torch``
process, as a share of the whole model's weight bytes (the ``memory`` entry of each run's report),
and the per-stage figures against the stage's own weight bytes.

    python benchmarks/big_model.py [--layers 12] [--width 2048] [--steps 3] [--dir out/big_model]

A worker of the pipelined meta path holds its stage's weights once and their gradients once
(plain SGD: no optimizer state), plus the activations of the microbatches in flight and the
process's own libraries; with one microbatch per update the gradients go as they are made.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

DATA = "text:block_size=64"


def bare_torch_rss() -> int:
    """Peak RSS of a process that imported torch and nothing else (bytes)."""
    code = "import resource, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def weight_bytes(layers: int, width: int, vocab: int = 96, block: int = 64) -> int:
    """float32 bytes of the GPT's parameters (blocks, embeddings, final norm, untied head)."""
    block_params = 12 * width * width + 13 * width
    return 4 * (layers * block_params + vocab * width + block * width + 2 * width + width * vocab)


def run(label: str, extra: list[str], args: argparse.Namespace) -> dict:
    report = os.path.join(args.dir, f"{label}.json")
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", "--model",
        f"gpt:n_layer={args.layers},n_embd={args.width},n_head={args.heads}", "--data", DATA,
        "--stages", "4", "--schedule", "1f1b", "--steps", str(args.steps), "--optimizer", "sgd:lr=0.01", "--eval-samples", "8", "--timeout", "1200", "--no-progress",
        "--report-json", report, *extra,
    ]
    print(f"\n$ {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    with open(report, encoding="utf-8") as handle:
        result = json.load(handle)
    result["wall_seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default="out/big_model")
    parser.add_argument("--single-batch", type=int, default=2,
                        help="samples per update of the one-microbatch run (default 2)")
    parser.add_argument("--skip-eager", action="store_true", help="the meta path only")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    total = weight_bytes(args.layers, args.width)
    bare = bare_torch_rss()
    print(f"model: {args.layers} layers, width {args.width}: {total / 1e9:.2f} GB of float32 weights; "
          f"bare `import torch` peak RSS {bare / 1e6:.0f} MB; {os.cpu_count()} CPUs, {platform.platform()}")
    pipelined = ["--batch-size", "8", "--microbatches", "4"]
    runs = {"meta": run("meta", ["--init", "meta", *pipelined, "--save", os.path.join(args.dir, "weights")], args),
            "meta-1": run("meta-1", ["--init", "meta", "--batch-size", str(args.single_batch), "--microbatches", "1",
                                     "--balance-by", "params"], args)}
    if not args.skip_eager:
        runs["eager"] = run("eager", ["--balance-by", "params", *pipelined], args)
    print(f"\n{'path':7} {'stage':>5} {'params (GB)':>12} {'peak RSS - bare (GB)':>21} {'/ model weights':>16} "
          f"{'/ stage weights':>16}")
    worst = {}
    for label, result in runs.items():
        stages = result["memory"]["stages"]
        choice = result["stage_choice"]["stages"]
        for entry, chosen in zip(stages, choice):
            above = entry["peak_bytes"] - bare
            stage_bytes = 4 * chosen["parameters"]
            worst[label] = max(worst.get(label, 0.0), above / total)
            print(f"{label:7} {entry['stage']:>5} {stage_bytes / 1e9:>12.3f} {above / 1e9:>21.3f} "
                  f"{above / total:>16.3f} {above / stage_bytes:>16.2f}")
        print(f"{label:7} wall {result['wall_seconds']:.0f} s, {result['samples_per_s']:.2f} samples/s, "
              f"final loss {result['final_loss']:.4f}")
    print("\nlargest worker / model weights: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
