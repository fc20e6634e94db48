"""benchmarks/stage_cpu.py: its probe counts every StageExecutor call of a process, and the ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stage_cpu import PROBE, ratios_to_first, read_probe  # noqa: E402

_WORKER = """
import os, torch
from pipetrain.execution.stage import StageExecutor
from pipetrain.models.loss import cross_entropy
torch.manual_seed(0)
executor = StageExecutor(0, torch.nn.Linear(8, 3), None, loss_fn=cross_entropy)
for k in range(5):
    executor.forward(k, 0, torch.randn(4, 8), target=torch.randint(0, 3, (4,)), samples=4)
    executor.backward(k, 0, None)
executor.forward(5, 0, torch.randn(4, 8), target=torch.randint(0, 3, (4,)), samples=4)
os._exit(0)  # how a worker ends: the probe writes its file on the way out
"""


def _run_worker(tmp_path: Path, rank: str | None) -> None:
    env = dict(os.environ, PIPETRAIN_CPU_PROBE=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(PROBE), str(ROOT / "src")]))
    env.pop("RANK", None)
    if rank is not None:
        env["RANK"] = rank
    subprocess.run([sys.executable, "-c", _WORKER], env=env, check=True, timeout=120)


def test_the_probe_counts_every_call_of_a_worker_and_leaves_out_processes_without_a_rank(tmp_path):
    _run_worker(tmp_path, "1")
    _run_worker(tmp_path, None)  # a launcher-like process: written, then left out
    assert len(list(tmp_path.glob("*.json"))) == 2
    ranks = read_probe(tmp_path)
    assert list(ranks) == [1]
    calls = ranks[1]
    assert calls["forward"]["calls"] == 6 and calls["backward"]["calls"] == 5
    for method in ("forward", "backward"):
        assert 0 < calls[method]["cpu_us"] and 0 < calls[method]["wall_us"]
        assert calls[method]["faults"] >= 0 and calls[method]["switches"] >= 0


def test_without_the_variable_the_probe_wraps_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PROBE), str(ROOT / "src")]))
    env.pop("PIPETRAIN_CPU_PROBE", None)
    code = "from pipetrain.execution.stage import StageExecutor; assert not hasattr(StageExecutor.forward, '__wrapped__')"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_ratios_are_medians_of_each_rounds_cpu_against_the_first_contender():
    def contender(cpu_forward, cpu_backward):
        return {"rate": 1.0, "ranks": {0: {"forward": {"cpu_us": cpu_forward}, "backward": {"cpu_us": cpu_backward}}}}

    rounds = [
        {"a": contender(100, 200), "b": contender(110, 180)},
        {"a": contender(200, 100), "b": contender(260, 100)},
        {"a": contender(100, 100), "b": contender(100, 130)},
    ]
    got = ratios_to_first(rounds, ["a", "b"])
    assert got == {("b", 0, "forward"): pytest.approx(1.1), ("b", 0, "backward"): pytest.approx(1.0)}


def test_the_hand_loops_run_with_the_probe_in_both_workers(tmp_path):
    from benchmarks.stage_cpu import probed
    from benchmarks.vs_torch_pipelining import Config

    tiny = Config(width=8, batch=8, microbatches=2, steps=1, warmup=0, hidden=4)
    for name in ("loop-1f1b-executors", "loop-1f1b-updating", "loop-1f1b-labels"):
        directory = tmp_path / name
        directory.mkdir()
        assert probed(name, tiny, 3, 1, directory) > 0  # 3 timed steps after 1
        ranks = read_probe(directory)
        assert sorted(ranks) == [0, 1]
        assert all(calls[m]["calls"] == 4 * 2 for calls in ranks.values() for m in ("forward", "backward"))
    assert "PIPETRAIN_CPU_PROBE" not in os.environ  # put back as it was
