"""What a crash costs: a run whose worker is killed mid-run and restarted against the same run
uninterrupted, under `pipetrain train --max-restarts 1` (the launcher restarts its workers) and under
two torchrun agents on 127.0.0.1 with `--max-restarts 1` (torchrun restarts them); both resume from
`--checkpoint-dir` by themselves.

The run: PipeDream, 2 stages of an MLP (4 layers of width 64) on 2 workers, synthetic data, 300
updates of 16 samples, a checkpoint every 30 updates; the killed run loses rank 1 (SIGKILL, fault
injection) right before the action at 60 % of its program, so it resumes from the checkpoint of
step 180 and trains the 120 updates after it again, less what it had done since.

Timed from the outside, from the lines each run prints as they come:

* rejoin: from the line that says the worker died (the launcher's "was killed by SIGKILL",
  torchrun's "failed (exitcode: -9)") to the restarted rank 0's "resuming from step ..." (every
  worker of the new start has been started, has imported pipetrain and torch, has joined the
  process group and has been told the checkpoint);
* total: the whole command, killed against uninterrupted, in the same round (rounds alternate the
  order A B, B A, ...); the median of the per-round ratios is reported.

Usage::

    python benchmarks/restart.py [--rounds 3] [--launchers pipetrain,torchrun]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
OPTIONS = ["--schedule", "pipedream", "--stages", "2", "--model", "mlp:depth=4,width=64",
           "--data", "synthetic:features=32,classes=4,samples=4800", "--batch-size", "16", "--steps", "300",
           "--checkpoint-every", "30", "--no-progress", "--timeout", "60"]
DIED = re.compile(r"was killed by SIGKILL|failed \(exitcode: -9\)")
RESUMED = re.compile(r"^resuming from step")


def _kill_position() -> str:
    sys.path.insert(0, SRC)
    from pipetrain.training import TrainConfig, prepare

    config = TrainConfig(schedule="pipedream", stages=2, model="mlp:depth=4,width=64",
                         data="synthetic:features=32,classes=4,samples=4800", batch_size=16, steps=300)
    return f"1:{int(0.6 * len(prepare(config).schedule.programs[1]))}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(launcher: str, directory: str, restarts: int) -> list[list[str]]:
    train = ["--executor", "distributed", *OPTIONS, "--checkpoint-dir", os.path.join(directory, "ck")]
    if launcher == "pipetrain":
        return [[sys.executable, "-m", "pipetrain.cli", "train", *train, "--max-restarts", str(restarts)]]
    port = _free_port()
    return [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-benchmark",
         "--rdzv-conf", f"is_host={1 - node},join_timeout=120", "--max-restarts", str(restarts),
         "--monitor-interval", "0.1", "-m", "pipetrain.cli", "train", *train]
        for node in (0, 1)
    ]


def one_run(launcher: str, killed: bool, fault: str) -> dict[str, float]:
    """One run: its total seconds, and when killed the seconds from the death to the resumption."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC)
    if killed:
        env["PIPETRAIN_FAULT_INJECT"] = fault
    events: dict[str, float] = {}

    def watch(stream) -> None:
        for line in stream:
            now = time.monotonic()
            if DIED.search(line):
                events.setdefault("died", now)
            elif RESUMED.search(line):
                events.setdefault("resumed", now)

    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for command in _commands(launcher, directory, 1)]
        readers = [threading.Thread(target=watch, args=(p.stdout,)) for p in procs]
        for reader in readers:
            reader.start()
        codes = [p.wait(timeout=900) for p in procs]
        for reader in readers:
            reader.join()
        total = time.monotonic() - started
    if any(codes):
        raise SystemExit(f"{launcher} {'killed' if killed else 'plain'} run failed: {codes}")
    out = {"total": total}
    if killed:
        if "died" not in events or "resumed" not in events:
            raise SystemExit(f"{launcher}: the death or the resumption was not seen ({events})")
        out["rejoin"] = events["resumed"] - events["died"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launchers", default="pipetrain,torchrun")
    args = parser.parse_args()
    fault = _kill_position()
    print(f"load average at start: {os.getloadavg()[0]:.1f}; rank 1 killed before position {fault.split(':')[1]}")
    for launcher in args.launchers.split(","):
        ratios, rejoins, plain, killed = [], [], [], []
        for round_ in range(args.rounds):
            order = [False, True] if round_ % 2 == 0 else [True, False]
            results = {kill: one_run(launcher, kill, fault) for kill in order}
            plain.append(results[False]["total"])
            killed.append(results[True]["total"])
            ratios.append(results[True]["total"] / results[False]["total"])
            rejoins.append(results[True]["rejoin"])
            print(f"  {launcher} round {round_ + 1}: uninterrupted {plain[-1]:.1f} s, killed and restarted "
                  f"{killed[-1]:.1f} s (rejoined {rejoins[-1]:.1f} s after the death)", flush=True)
        print(f"{launcher}: rejoin median {statistics.median(rejoins):.1f} s (range {min(rejoins):.1f}-{max(rejoins):.1f}); "
              f"killed run / uninterrupted run: median {statistics.median(ratios):.2f}x "
              f"(uninterrupted median {statistics.median(plain):.1f} s, killed {statistics.median(killed):.1f} s)")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
