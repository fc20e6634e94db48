"""How soon `pipetrain train` ends after a fault, timed from the outside (issue 39's user trial).

Every trial starts a real run (PipeDream, 2 stages of a small MLP, 2 workers, a checkpoint every
20 updates) and, once it trains, does one of:

* ``stop``: SIGSTOP worker rank 1, with ``--timeout 5``: the seconds from the stop to the
  command's exit (promised: ``--timeout`` + 2 s);
* ``kill-reader``: SIGKILL rank 0, which reads the data in a DataLoader worker process
  (``--data-workers 1``), and ``kill-other``: SIGKILL rank 1, which reads none: the seconds from
  the kill to the exit;
* ``kill-startup``: SIGKILL rank 1 as soon as its process appears (the other still setting up);
* ``interrupt``: SIGINT to the command while it checkpoints after every update: whether a
  temporary (``.*.tmp-*``) is left in the checkpoint directory.

Usage (tests/ must be importable for the data set that ``kill-*`` reads in worker processes)::

    PYTHONPATH=src:tests python benchmarks/fault_times.py [--trials 4] [--only stop,kill-reader]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from launched_workers import workers

BASE = ["--executor", "distributed", "--model", "mlp:depth=5,width=16", "--schedule", "pipedream", "--stages", "2",
        "--batch-size", "12", "--no-progress", "--quiet"]
SYNTHETIC = ["--data", "synthetic:features=8,classes=3,samples=96"]
READ_IN_WORKERS = ["--data", "dying_data:make", "--data-workers", "1"]  # a plain Dataset: DataLoader workers


def start(directory: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipetrain.cli", "train", *BASE, *argv,
                             "--checkpoint-dir", str(directory / "ck")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def training(directory: Path, process: subprocess.Popen, seconds: float = 180) -> None:
    """Until a complete checkpoint is there: the run trains."""
    deadline = time.monotonic() + seconds
    while not any((directory / "ck").glob("step-*/manifest.json")):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run did not get going: {process.communicate()[1][-2000:]}")
        time.sleep(0.05)


def ended(process: subprocess.Popen, since: float) -> tuple[float, int, str]:
    _, err = process.communicate(timeout=300)
    return time.monotonic() - since, process.returncode, err.strip().splitlines()[-1] if err.strip() else ""


def fault(kind: str) -> tuple[float | str, int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if kind == "kill-startup":
            process = start(directory, *SYNTHETIC, "--steps", "3000", "--checkpoint-every", "20")
            while 1 not in (found := workers(process.pid)):
                time.sleep(0.01)
            time.sleep(0.5)  # it runs: importing, joining; the other sets up
            os.kill(found[1], signal.SIGKILL)
            return ended(process, time.monotonic())
        if kind == "interrupt":
            process = start(directory, *SYNTHETIC, "--steps", "3000", "--checkpoint-every", "1", "--keep", "50")
            training(directory, process)
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
            _, code, last = ended(process, time.monotonic())
            left = [str(p.relative_to(directory)) for p in (directory / "ck").rglob(".*.tmp-*")]
            return ("temporaries left: " + ", ".join(left)) if left else "no temporary left", code, last
        data = READ_IN_WORKERS if kind.startswith("kill-") else SYNTHETIC
        timeout = ["--timeout", "5"] if kind == "stop" else ["--timeout", "20"]
        process = start(directory, *data, *timeout, "--steps", "3000", "--checkpoint-every", "20")
        training(directory, process)
        rank = 0 if kind == "kill-reader" else 1
        pid = workers(process.pid)[rank]
        os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        try:
            return ended(process, time.monotonic())
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--only", default="stop,kill-reader,kill-other,kill-startup,interrupt")
    args = parser.parse_args()
    for kind in args.only.split(","):
        for trial in range(args.trials):
            seconds, code, last = fault(kind)
            shown = f"{seconds:.2f} s" if isinstance(seconds, float) else seconds
            print(f"{kind:13s} trial {trial + 1}: {shown}, exit {code}: {last[:150]}", flush=True)


if __name__ == "__main__":
    main()
