"""Local worker processes and torchrun (pipetrain.runtime.launch)."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torchrun_agents

from pipetrain.runtime.errors import LaunchError
from pipetrain.runtime.launch import detect, init_distributed, launch, plan_cores

SRC = str(Path(__file__).resolve().parents[1] / "src")
LIMIT = 60


def _listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address = bytes.fromhex(fields[1].split(":")[0])
                    words = b"".join(address[i:i + 4][::-1] for i in range(0, len(address), 4))  # little-endian words
                    found.append(socket.inet_ntop(family, words))
    return found


def _env_worker():
    import torch

    env = init_distributed("gloo", timeout=LIMIT)
    torch.distributed.barrier()  # every connection of the process group is made
    return {
        "env": env,
        "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "world": torch.distributed.get_world_size(),
        "listening": _listening(os.getpid()) + _listening(os.getppid()),  # the worker's and the launcher's
        "collector": (gc.isenabled(), gc.get_freeze_count() > 0),  # paused to load, then on, the modules frozen
    }


def test_workers_get_ranks_threads_and_disjoint_cores():
    result = launch(_env_worker, (), 2, threads_per_worker=1, timeout=LIMIT, quiet=True)
    assert result.returncode == 0 and result.exitcodes == [0, 0]
    # the launcher's store and gloo's sockets listen on loopback only: nothing of a local run is reachable
    # from another machine
    listening = [address for r in result.results for address in r["listening"]]
    assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening
    envs = [r["env"] for r in result.results]
    assert [e.rank for e in envs] == [0, 1] and [e.local_rank for e in envs] == [0, 1]
    assert all(e.world_size == 2 and e.launcher == "pipetrain" for e in envs)
    assert all(r["threads"] == 1 and r["world"] == 2 and r["collector"] == (True, True) for r in result.results)
    if len(os.sched_getaffinity(0)) >= 2:
        cpus = [r["cpus"] for r in result.results]
        assert len(cpus[0]) == 1 and len(cpus[1]) == 1 and cpus[0] != cpus[1]


def _crash_once(code):
    """Rank 1 ends with ``code`` (a negative one: killed by that signal) in the first start only."""
    rank, restart = int(os.environ["RANK"]), int(os.environ["PIPETRAIN_RESTART"])
    if rank == 1 and restart == 0:
        if code < 0:
            os.kill(os.getpid(), -code)
        raise SystemExit(code)
    return restart


def test_workers_are_started_again_after_a_failure_that_is_not_a_user_error(capfd):
    result = launch(_crash_once, (-signal.SIGKILL,), 2, timeout=LIMIT, restarts=2)
    assert result.returncode == 0 and result.restarts == 1 and result.results == [1, 1]
    assert "worker rank 1 was killed by SIGKILL: starting the workers again (restart 1 of 2)" in capfd.readouterr().err
    user_error = launch(_crash_once, (2,), 2, timeout=LIMIT, restarts=2, quiet=True)  # would fail the same way again
    assert user_error.returncode == 2 and user_error.restarts == 0


def test_plan_cores():
    assert plan_cores(2, 2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert plan_cores(3, 1, [5, 3, 4]) == [[3], [4], [5]]
    assert plan_cores(3, 2, [0, 1, 2, 3]) is None  # too few cores: no pinning


def _fail_worker(how):
    import torch.distributed  # noqa: F401  (same start-up cost as a real worker)

    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(0.3)
        if how == "raise":
            raise ValueError("boom in rank 1")
        if how == "user-error":
            from pipetrain.errors import ConfigError

            raise ConfigError("bad option in rank 1")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the others would run on: the launcher must stop them


@pytest.mark.parametrize(
    "how, code, text",
    [
        ("raise", 1, "ValueError: boom in rank 1"),
        ("kill", 128 + 9, "worker rank 1 was killed by SIGKILL"),
    ],
)
def test_a_failing_worker_stops_the_others(how, code, text, capfd):
    start = time.monotonic()
    result = launch(_fail_worker, (how,), 3 if how == "kill" else 2, grace=1.0, timeout=LIMIT)
    elapsed = time.monotonic() - start
    assert result.returncode == code
    assert result.exitcodes[1] != 0 and result.exitcodes[0] == -signal.SIGTERM
    assert elapsed < 20, "the launcher must stop the other workers soon after a failure"
    err = capfd.readouterr().err
    assert text in err
    assert "stopping the other workers" in err


def test_a_workers_own_error_is_the_runs_one_message(capfd):
    # a user error (ConfigError) in rank 1: the launcher hands its message on as the run's message;
    # neither the worker nor the launcher prints it, nor the status of every rank (nobody hangs)
    result = launch(_fail_worker, ("user-error",), 2, grace=1.0, timeout=LIMIT)
    assert result.returncode == 2
    assert result.message == "bad option in rank 1"
    err = capfd.readouterr().err
    assert "bad option" not in err and "status of every rank" not in err


def _sleep_worker(pidfile):
    with open(f"{pidfile}.{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def test_overall_timeout_terminates_everything(tmp_path):
    result = launch(_sleep_worker, (str(tmp_path / "pid"),), 2, timeout=3.0, quiet=True)
    assert result.returncode == 124
    assert all(c is not None and c != 0 for c in result.exitcodes)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting its reaper counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum, status, said, workers", [(signal.SIGINT, 130, "interrupted", 2),
                                                            (signal.SIGTERM, 143, "terminated by SIGTERM", 1)])
def test_ctrl_c_or_sigterm_stops_every_worker_and_returns_128_plus_the_signal(tmp_path, signum, status, said,
                                                                              workers):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time, os
            from pipetrain.runtime.launch import launch
            # Ctrl-C raises KeyboardInterrupt even where the test runs with SIGINT ignored (a background job)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            def sleeper(pidfile):
                with open(pidfile + "." + os.environ["RANK"], "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)
            if __name__ == "__main__":
                sys.exit(launch(sleeper, ({str(tmp_path / "pid")!r},), {workers}, timeout={LIMIT}).returncode)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        pidfiles = [tmp_path / f"pid.{r}" for r in range(workers)]
        while not all(p.exists() and p.read_text() for p in pidfiles):
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in pidfiles]
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status  # as a shell reports a process ended by that signal
    assert said in err
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def test_detect_reads_the_environment():
    assert detect({}) is None
    env = detect({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
                  "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                  "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2"})  # fmt: skip
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (1, 4, 0, 1)
    assert env.launcher == "torchrun" and env.restart == 2
    with pytest.raises(LaunchError, match="MASTER_PORT missing"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(LaunchError, match="outside"):
        detect({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_init_distributed_without_environment_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(LaunchError, match="torchrun"):
        init_distributed()


TORCHRUN_WORKER = """
import time
import torch
from pipetrain.runtime.launch import init_distributed
from pipetrain.runtime.p2p import Messenger
from pipetrain.runtime.status import StatusBoard

env = init_distributed("gloo", timeout=60)
board = StatusBoard.from_env(interval=0.05)  # on torchrun's agent store
m = Messenger(timeout=60, status=board)
if env.rank == 0:
    m.send((torch.arange(6.0).reshape(2, 3), torch.tensor([env.rank])), 1, "act")
    print("rank 0 got", m.recv(1, "grad").tolist(), env.launcher, flush=True)
    board.done("B0")
else:
    x, r = m.recv(0, "act")
    board.done("F0")
    m.send(x.sum(0) * 2, 0, "grad")
    print("rank 1 done", env.launcher, flush=True)
time.sleep(0.3)
torch.distributed.barrier()
print(f"report of rank {env.rank}:", board.report().replace("\\n", " | "), flush=True)
board.close()
"""


def test_two_torchrun_nodes_meet_at_the_rendezvous(tmp_path):
    """The multi-machine path on one machine: two torchrun agents, one worker each, c10d rendezvous."""
    worker = tmp_path / "worker.py"
    worker.write_text(TORCHRUN_WORKER)
    codes, text = torchrun_agents.run([str(worker)], rdzv_id="pipetrain-test", join_timeout=60, timeout=120)
    assert codes == [0, 0], text
    assert "rank 0 got [6.0, 10.0, 14.0] torchrun" in text
    assert "rank 1 done torchrun" in text
    for rank in (0, 1):  # the status board works on torchrun's store
        report = next(line for line in text.splitlines() if line.startswith(f"report of rank {rank}:"))
        assert "rank 0: busy (not communicating); done: B0" in report, report
        assert "rank 1: busy (not communicating); done: F0" in report, report


def test_an_entry_that_cannot_reach_the_workers_is_refused():
    from pipetrain.errors import PipetrainError

    with pytest.raises(PipetrainError, match="module-level function and picklable arguments"):
        launch(lambda: None, (), 2)
