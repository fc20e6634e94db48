"""What activation recomputation (``--recompute stage``) costs in time and saves in memory, on the CPU.

Each run is its own ``pipetrain train --executor emulate`` process (one thread), so that its peak
resident set size is its own: the report's ``memory`` gives the process's peak and its size when
training began. Their difference is how far training pushed the peak above that size (the
activations held, the allocator's caches, versions and optimizer state made during training); a
run whose training stays below a peak reached before it (reading the data, cutting the model)
shows nearly 0, so the ratio of the differences is a bound, not the ratio of activations. Rounds run every mode once, in reverse order every other
round; the ratios to ``none`` are taken within a round and their medians printed, with each run's
samples/s and the memory model's predicted peaks of stage 0.

Usage::

    PYTHONPATH=src python benchmarks/recompute.py [--rounds 3] [--steps 12] [--schedule gpipe]
        [--model gpt:n_layer=4,n_embd=128,n_head=4] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile


def run_once(args: argparse.Namespace, recompute: str, directory: str, index: int) -> dict:
    report = os.path.join(directory, f"{recompute}-{index}.json")
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", "--executor", "emulate", "--model", args.model,
        "--data", f"text:block_size={args.block}", "--schedule", args.schedule, "--stages", str(args.stages),
        "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches), "--steps", str(args.steps),
        "--optimizer", "adam:lr=0.001", "--precision", args.precision, "--recompute", recompute,
        "--threads-per-worker", "1", "--no-progress", "--quiet", "--report-json", report,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(report, encoding="utf-8") as handle:
        data = json.load(handle)
    stage = data["memory"]["stages"][0]
    return {"rate": data.get("steady_samples_per_s") or data["samples_per_s"],
            "added": stage["peak_bytes"] - stage["start_bytes"], "peak": stage["peak_bytes"], "loss": data["final_loss"],
            "predicted": (stage["predicted_peak_activations"], stage.get("predicted_peak_inputs", 0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", default="gpt:n_layer=4,n_embd=128,n_head=4")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{args.model}, text block {args.block}, {args.schedule} on {args.stages} stages, batch {args.batch_size} "
          f"in {args.microbatches} microbatches, {args.steps} steps, {args.precision}")
    modes = ["none", "stage"]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as directory:
        for index in range(args.rounds):
            for mode in (modes if index % 2 == 0 else modes[::-1]):
                results[mode].append(run_once(args, mode, directory, index))
            print(f"round {index + 1}: " + ", ".join(
                f"{mode} {results[mode][-1]['rate']:.0f} samples/s, +{results[mode][-1]['added'] / 2**20:.0f} MiB"
                for mode in modes), flush=True)
    losses = {mode: {r["loss"] for r in results[mode]} for mode in modes}
    time_ratio = statistics.median(n["rate"] / s["rate"] for n, s in zip(results["none"], results["stage"]))
    memory_ratio = statistics.median(s["added"] / n["added"] for n, s in zip(results["none"], results["stage"]))
    for mode in modes:
        rates = [r["rate"] for r in results[mode]]
        added = [r["added"] / 2**20 for r in results[mode]]
        peaks = [r["peak"] / 2**20 for r in results[mode]]
        activations, inputs = results[mode][0]["predicted"]
        print(f"  {mode:<6} samples/s median {statistics.median(rates):8.0f}   peak RSS median {statistics.median(peaks):6.0f} "
              f"MiB, {statistics.median(added):5.0f} MiB above the start of training   stage 0 predicted: "
              f"{activations} graphs, {inputs} inputs kept")
    print(f"recompute stage against none: {time_ratio:.3f}x the time, {memory_ratio:.3f}x the memory added "
          f"(medians of {args.rounds} rounds); final losses equal: {losses['none'] == losses['stage']}")


if __name__ == "__main__":
    main()
