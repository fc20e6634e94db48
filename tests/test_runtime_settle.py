"""A spawned worker's process settings (runtime/settle.py): its cores set before PyTorch is imported,
and no life beyond its parent's."""

import os
import signal
import subprocess
import sys
import time

import pytest


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=60)


def test_settle_pins_the_worker_to_its_cores_without_importing_pytorch():
    core = sorted(os.sched_getaffinity(0))[-1]
    result = _python("import os, sys; from pipetrain.runtime.settle import settle; settle(); "
                     "print(sorted(os.sched_getaffinity(0)), 'torch' in sys.modules)", PIPETRAIN_CPUS=str(core))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"[{core}]", "False"]


def test_settle_without_cores_leaves_the_affinity_as_it_is():
    result = _python("import os; from pipetrain.runtime.settle import settle; settle(); "
                     "print(len(os.sched_getaffinity(0)))")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(os.sched_getaffinity(0))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_its_parent():
    child = ("import os, time; from pipetrain.runtime.settle import die_with_parent; "
             "die_with_parent(os.getppid()); print('ready', flush=True); time.sleep(60)")
    parent = (f"import os, subprocess, sys; child = subprocess.Popen([sys.executable, '-c', {child!r}], "
              "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True); child.stdout.readline(); print(child.pid, flush=True); os._exit(0)")
    result = _python(parent)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
