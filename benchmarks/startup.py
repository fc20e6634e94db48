"""Start-up with and without Python's garbage collector while the libraries load (pipetrain.collector).

    PYTHONPATH=src python benchmarks/startup.py                     # imports: plain against loading()
    PYTHONPATH=src python benchmarks/startup.py --against 82eef99   # also whole runs against a commit

Imports: each round starts two fresh interpreters, in turn, that import what a spawned worker
imports (PyTorch, torch.distributed, ``pipetrain.training.distributed``): one plainly, one under
:func:`pipetrain.collector.loading`. Each times its own imports. ``--against REF``: each round also
runs ``pipetrain train --steps 3 --stages 2`` (the embedded default: 2 workers on the distributed
runtime) from this tree and from a clone of commit ``REF``, in turn, timed as whole processes.
Printed: each figure's median over the rounds and the median of the per-round ratios (this tree
over the baseline), which holds when the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

_IMPORTS = "import torch, torch.distributed\nimport pipetrain.training.distributed\n"
_TIMED = ("import time\nstart = time.perf_counter()\n{body}print(time.perf_counter() - start)\n")


def _imports(paused: bool) -> float:
    body = ("from pipetrain.collector import loading\nwith loading():\n"
            + "".join("    " + line + "\n" for line in _IMPORTS.splitlines())) if paused else _IMPORTS
    done = subprocess.run([sys.executable, "-c", _TIMED.format(body=body)], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _whole_run(src: str, workdir: str) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "--steps", "3", "--stages", "2", "--quiet"],
                   cwd=workdir, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def _paired(name: str, ours: list[float], theirs: list[float]) -> None:
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(f"{name:<34} {statistics.median(theirs):9.3f} {statistics.median(ours):9.3f} "
          f"{statistics.median(ratios):7.3f}  ({min(ratios):.3f}-{max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8)")
    parser.add_argument("--against", metavar="REF", help="a commit of this repository to time whole runs against")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rounds} paired rounds")
    print(f"{'what':<34} {'baseline s':>9} {'ours s':>9} {'ratio':>7}  (range)")
    _imports(False)  # warm the file cache
    plain, paused = [], []
    for _ in range(args.rounds):
        plain.append(_imports(False))
        paused.append(_imports(True))
    _paired("imports (plain | loading)", paused, plain)
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "clone", "-q", here, os.path.join(tmp, "ref")], check=True)
            subprocess.run(["git", "-C", os.path.join(tmp, "ref"), "checkout", "-q", args.against], check=True)
            theirs_src, ours_src = os.path.join(tmp, "ref", "src"), os.path.join(here, "src")
            _whole_run(ours_src, tmp)
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(_whole_run(ours_src, tmp))
                theirs.append(_whole_run(theirs_src, tmp))
            _paired(f"pipetrain train ({args.against} | tree)", ours, theirs)


if __name__ == "__main__":
    main()
