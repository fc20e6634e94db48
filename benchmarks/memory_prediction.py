"""Predicted against measured memory per worker: the report's ``predicted_bytes`` beside each
worker's peak resident set above its start (issue 36's memory goal: within 15 %).

    PYTHONPATH=src python benchmarks/memory_prediction.py                    # the 4-stage GPT, 3 schedules
    PYTHONPATH=src python benchmarks/memory_prediction.py --cases big        # benchmarks/big_model.py's GPT
    PYTHONPATH=src python benchmarks/memory_prediction.py --mmap-threshold 65536   # glibc returns blocks

Cases (4 workers, ``pipetrain train`` on the distributed runtime, a calibration for each worker's
own first-use memory, measured first unless ``--costs-file``):

* ``gpt``: a character GPT of 4 layers of width 1024 (202 MB of float32 weights, a layer a stage),
  batch 8 of 64 tokens in 4 microbatches, momentum SGD, under 1f1b, pipedream and zb-h1;
* ``big``: benchmarks/big_model.py's GPT (12 layers of width 2048, 2.42 GB) built on the meta device,
  plain SGD, pipelined (batch 8 in 4 microbatches, 1f1b) and one microbatch per update (batch 2,
  each update made during the backward).

Each row: per rank, ``peak_bytes - start_bytes`` (the kernel's high-water mark of the worker's
resident set since training began, minus the set then), ``predicted_bytes`` and their ratio, and
the prediction's parts. ``--mmap-threshold N`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` in the
workers' environment: every block of N bytes or more is mapped and returned on its own, so the
resident set follows the tensors alive rather than the allocator's heap (docs/gpu.md, "Memory in
the report").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

GPT = dict(model="gpt:n_layer=4,n_embd=1024,n_head=8", extra=["--batch-size", "8", "--microbatches", "4",
                                                              "--optimizer", "sgd:lr=0.01,momentum=0.9"])
BIG = "gpt:n_layer=12,n_embd=2048,n_head=16"
CASES = {
    "gpt": [(f"gpt {s}", GPT["model"], ["--schedule", s, *GPT["extra"]]) for s in ("1f1b", "pipedream", "zb-h1")],
    "big": [("big pipelined", BIG, ["--schedule", "1f1b", "--init", "meta", "--batch-size", "8", "--microbatches", "4",
                                    "--optimizer", "sgd:lr=0.01"]),
            ("big one microbatch", BIG, ["--schedule", "1f1b", "--init", "meta", "--batch-size", "2",
                                         "--microbatches", "1", "--balance-by", "params", "--optimizer", "sgd:lr=0.01"])],
}


def _run(label: str, model: str, extra: list[str], args: argparse.Namespace, costs: str, tmp: str) -> dict:
    report = os.path.join(tmp, "report.json")
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    command = [sys.executable, "-m", "pipetrain.cli", "train", "--model", model, "--data", "text:block_size=64",
               "--stages", "4", "--steps", str(args.steps), "--eval-samples", "8", "--timeout", "1200",
               "--no-progress", "--quiet", "--costs-file", costs, "--report-json", report, *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"label": label, "error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    with open(report, encoding="utf-8") as handle:
        return {"label": label, **json.load(handle)["memory"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="gpt", help=f"comma-separated: {', '.join(CASES)} (default gpt)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mmap-threshold", type=int, default=0, help="glibc's MALLOC_MMAP_THRESHOLD_ (default: "
                                                                      "glibc's own, dynamic)")
    parser.add_argument("--costs-file", default=None, help="a calibration (default: measured first)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    tmp = tempfile.mkdtemp(prefix="memory-")
    costs = args.costs_file or os.path.join(tmp, "calibration.json")
    if args.costs_file is None:
        subprocess.run([sys.executable, "-m", "pipetrain.cli", "calibrate", "--out", costs], check=True,
                       capture_output=True)
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; MALLOC_MMAP_THRESHOLD_ "
          f"{args.mmap_threshold or 'unset (glibc dynamic)'}; {args.steps} steps")
    print(f"{'case':20s} {'rank':>4s} {'measured MB':>12s} {'predicted MB':>13s} {'ratio':>6s}  parts (MB)")
    for case in args.cases.split(","):
        for label, model, extra in CASES[case]:
            memory = _run(label, model, extra, args, costs, tmp)
            if "error" in memory:
                print(f"{label:20s} {memory['error']}")
                continue
            for stage in memory["stages"]:
                used = stage["peak_bytes"] - stage["start_bytes"]
                predicted = stage.get("predicted_bytes")
                parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in (stage.get("predicted_parts") or {}).items()
                                  if k != "total")
                ratio = f"{used / predicted:6.2f}" if predicted else "     -"
                print(f"{label:20s} {stage['stage']:>4d} {used / 1e6:12.1f} {(predicted or 0) / 1e6:13.1f} {ratio}  "
                      f"{parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
