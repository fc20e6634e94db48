"""Failures of the distributed runtime: a dead worker, restarts that resume exactly, damaged checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipetrain.schedule.cuts import cut
from pipetrain.training import TrainConfig, prepare
from launched_workers import kill_stopped, workers

SCRIPT = os.path.join(os.path.dirname(__file__), "restart_script.py")
BASE = ["--executor", "distributed", "--model", "mlp:depth=5,width=16",
        "--data", "synthetic:features=8,classes=3,samples=96", "--batch-size", "12", "--no-progress"]


def pipetrain(*argv, env=None, timeout=180):
    environment = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", *BASE, *argv], capture_output=True,
                          text=True, timeout=timeout, env=environment)


def position_after(schedule_args, steps, rank, extra=3):
    """A program position of ``rank`` a little after its cut at ``steps`` updates."""
    config = TrainConfig(model="mlp:depth=5,width=16", data="synthetic:features=8,classes=3,samples=96",
                         batch_size=12, **schedule_args)
    run = prepare(config)
    return cut(run.schedule, steps * run.layout.units_per_update).positions[rank] + extra


def test_a_killed_worker_stops_the_run_with_a_clear_message():
    position = position_after(dict(schedule="pipedream", stages=3, steps=40), 5, rank=1)
    started = time.monotonic()
    result = pipetrain("--schedule", "pipedream", "--stages", "3", "--steps", "40", "--timeout", "20",
                       env={"PIPETRAIN_FAULT_INJECT": f"1:{position}"})
    assert time.monotonic() - started < 60
    assert result.returncode == 128 + signal.SIGKILL  # the status reaches the shell: 128+N for signal N
    assert "worker rank 1 was killed by SIGKILL" in result.stderr
    assert "status of every rank" in result.stderr
    assert "deadlock" not in result.stderr  # no cause the status board does not support
    assert result.stderr.strip().splitlines()[-1] == "pipetrain train: error: worker rank 1 was killed by SIGKILL"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("schedule, extra", [
    ("pipedream", {}), ("1f1b", {"microbatches": 3}), ("pipedream", {"stages": 2, "replicas": [2, 1]}),
])
def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, schedule, extra):
    args = {"schedule": schedule, "stages": 3, "steps": 12, **extra}
    common = ["--schedule", schedule, "--stages", str(args["stages"]), "--steps", "12", "--checkpoint-every", "4"]
    if "microbatches" in extra:
        common += ["--microbatches", str(extra["microbatches"])]
    if "replicas" in extra:  # second replicas have no part in evaluations and go on past the pause
        common += ["--replicas", ",".join(map(str, extra["replicas"])), "--eval-every", "2"]
    full = pipetrain(*common, "--checkpoint-dir", str(tmp_path / "a"), "--save", str(tmp_path / "full.pt"),
                     "--report-json", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr
    # pausing at its checkpoints, the full run receives on demand, and so does the resumed one
    assert json.loads((tmp_path / "full.json").read_text())["receives"] == ["on-demand"] * 3
    position = position_after(args, 8, rank=2)
    killed = pipetrain(*common, "--checkpoint-dir", str(tmp_path / "b"), "--timeout", "20",
                       env={"PIPETRAIN_FAULT_INJECT": f"2:{position}"})
    assert killed.returncode != 0
    assert (tmp_path / "b" / "step-000008" / "manifest.json").exists()
    resumed = pipetrain(*common, "--checkpoint-dir", str(tmp_path / "b"), "--resume", "--save",
                        str(tmp_path / "resumed.pt"), "--report-json", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "resumed.json").read_text())
    assert report["receives"] == ["on-demand"] * 3
    if schedule == "1f1b":  # stages balanced by measured time: the resumed run is cut as the checkpointed one
        meta = json.loads((tmp_path / "b" / "step-000008" / "manifest.json").read_text())["meta"]
        assert report["stage_choice"]["how"] == "measured time"
        assert report["stage_choice"]["unit_seconds"] == meta["stage_costs"]
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def emulated(tmp_path, *argv, env=None) -> dict:
    """The parameters of the uninterrupted run, from the emulator (equal to the runtime's, bitwise)."""
    path = tmp_path / "emulated.pt"
    result = pipetrain(*argv, "--executor", "emulate", "--save", str(path), env=env)
    assert result.returncode == 0, result.stderr
    return torch.load(path)


def test_max_restarts_resumes_a_run_killed_at_a_random_point_exactly(tmp_path):
    common = ["--schedule", "pipedream", "--stages", "3", "--steps", "12"]
    rank = random.randrange(3)
    program = prepare(TrainConfig(model="mlp:depth=5,width=16", data="synthetic:features=8,classes=3,samples=96",
                                  batch_size=12, schedule="pipedream", stages=3, steps=12)).schedule.programs[rank]
    position = random.randrange(1, len(program))
    restarted = pipetrain(*common, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3",
                          "--max-restarts", "1", "--timeout", "20",
                          "--save", str(tmp_path / "restarted.pt"), "--report-json", str(tmp_path / "report.json"),
                          env={"PIPETRAIN_FAULT_INJECT": f"{rank}:{position}"})
    where = f"rank {rank} killed before position {position}"
    assert restarted.returncode == 0, (where, restarted.stderr)
    assert f"worker rank {rank} was killed by SIGKILL: starting the workers again (restart 1 of 1)" in restarted.stderr
    # each start says where it starts: afresh, then from the newest checkpoint (afresh again if none was made)
    assert restarted.stdout.count("no checkpoint in") + restarted.stdout.count("resuming from step") == 2
    # pausing at its checkpoints, the resumed run receives on demand
    assert json.loads((tmp_path / "report.json").read_text())["receives"] == ["on-demand"] * 3
    expected = emulated(tmp_path, *common, env={"PYTHONPATH": os.pathsep.join(sys.path)})
    got = torch.load(tmp_path / "restarted.pt")
    for key in expected:
        assert torch.equal(expected[key], got[key]), (where, key)


def test_a_script_restarts_its_workers_and_resumes_every_run_exactly(tmp_path):
    import restart_script

    kill = f"{random.choice(list(restart_script.RUNS))}:{random.randrange(restart_script.RUNS['1f1b']['steps'] - 1)}"
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--kill", kill], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, (kill, result.stderr)
    assert "was killed by SIGKILL: starting the workers again (restart 1 of 1)" in result.stderr
    restart_script.main([str(tmp_path), "--executor", "emulate"])
    for schedule in restart_script.RUNS:
        a, b = torch.load(tmp_path / f"{schedule}.pt"), torch.load(tmp_path / f"{schedule}-emulated.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (kill, schedule)


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    directory = tmp_path / "ck"
    run = pipetrain("--schedule", "1f1b", "--stages", "2", "--steps", "6", "--checkpoint-every", "2",
                    "--checkpoint-dir", str(directory))
    assert run.returncode == 0, run.stderr
    newest = directory / "step-000004"
    shard = newest / "rank-1.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    named = pipetrain("--schedule", "1f1b", "--stages", "2", "--steps", "6", "--checkpoint-dir", str(directory),
                      "--resume", str(newest))
    assert named.returncode == 2
    assert "damaged" in named.stderr and "rank-1.pt" in named.stderr and "Traceback" not in named.stderr
    other = pipetrain("--schedule", "gpipe", "--stages", "2", "--steps", "6", "--checkpoint-dir", str(directory),
                      "--resume")
    assert other.returncode == 2
    assert "different run" in other.stderr and "'1f1b'" in other.stderr and "'gpipe'" in other.stderr


def test_a_resumed_run_reports_the_evaluations_of_the_uninterrupted_one(tmp_path):
    common = ["--schedule", "1f1b", "--stages", "2", "--steps", "8", "--eval-every", "3", "--checkpoint-every", "2",
              "--checkpoint-dir", str(tmp_path / "ck")]
    full = pipetrain(*common, "--report-json", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr
    # step 6 both evaluates and checkpoints: the checkpoint must hold that evaluation and the earlier one
    resumed = pipetrain(*common, "--resume", str(tmp_path / "ck" / "step-000006"),
                        "--report-json", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "full.json").read_text())["evaluations"]
    b = json.loads((tmp_path / "resumed.json").read_text())["evaluations"]
    assert [e["step"] for e in a] == [3, 6, 8]
    assert a == b
    assert json.loads((tmp_path / "full.json").read_text())["receives"] == ["on-demand"] * 2


def _wait_for_checkpoint(directory, process, seconds=120):
    """Until a complete checkpoint is in ``directory`` (any step: a fast run prunes the first ones)."""
    deadline = time.monotonic() + seconds
    while not any(directory.glob("step-*/manifest.json")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"no checkpoint appeared in {directory}"
        time.sleep(0.05)


def test_a_stopped_worker_ends_the_run_within_the_timeout_and_two_seconds(tmp_path):
    timeout = 6
    process = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", *BASE, "--schedule", "pipedream", "--stages", "2",
         "--steps", "3000", "--timeout", str(timeout), "--checkpoint-dir", str(tmp_path / "ck"),
         "--checkpoint-every", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        _wait_for_checkpoint(tmp_path / "ck", process)  # training is under way
        stopped = workers(process.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        _, stderr = process.communicate(timeout=timeout + 60)
        elapsed = time.monotonic() - started
    finally:
        process.kill()
        kill_stopped(stopped)
    assert process.returncode == 3, stderr
    assert elapsed < timeout + 2, (elapsed, stderr)
    last = stderr.strip().splitlines()[-1]
    if last.startswith("pipetrain train: error: rank 1 fell silent "):  # the launcher heard nothing for --timeout
        assert f"s ago, longer than --timeout {timeout}: it is stopped (SIGSTOP, for instance) or frozen" in last
    else:  # rank 0's own wait ran out first: it began before the stop
        assert "rank(s) 1 silent (stopped or frozen): killing them (SIGKILL)" in stderr
        assert last.startswith("pipetrain train: error: worker rank 0 exited with status 3"), stderr
        assert "rank 1 is silent" in last or "rank(s) 1 fell silent" in last, stderr  # named last, either way


def test_a_second_run_in_a_checkpoint_directory_is_refused_and_a_stale_lock_taken_over(tmp_path):
    directory = tmp_path / "ck"
    common = ["--schedule", "pipedream", "--stages", "2", "--checkpoint-dir", str(directory)]
    first = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", "train", *BASE, *common, "--steps", "3000",
                              "--checkpoint-every", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(directory, first)
        for pid in [first.pid, *workers(first.pid).values()]:  # held where it is: a lock and a checkpoint or two
            os.kill(pid, signal.SIGSTOP)
        second = pipetrain(*common, "--steps", "3000")
    finally:
        first.kill()  # the launcher, SIGKILL: its workers die with it, its lock is left behind
        first.communicate(timeout=60)
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"pipetrain train: error: checkpoint directory {directory} is in use by another "
                                    f"run (pid {first.pid} on "), second.stderr
    assert json.loads((directory / ".pipetrain-lock").read_text())["pid"] == first.pid  # stale now
    third = pipetrain(*common, "--steps", "200")
    assert third.returncode == 0, third.stderr
    assert f"took over the lock of {directory} left by pid {first.pid} on " in third.stdout
    assert "resuming from step" in third.stdout
    assert not (directory / ".pipetrain-lock").exists()  # released at the end of the run


def test_a_killed_data_worker_is_a_fault_the_run_restarts_from_exactly(tmp_path):
    common = ["--data", "dying_data:make:die_after=100", "--data-workers", "1", "--schedule", "pipedream",
              "--stages", "2", "--steps", "16"]
    restarted = pipetrain(*common, "--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ck"),
                          "--checkpoint-every", "4", "--timeout", "20", "--save", str(tmp_path / "restarted.pt"),
                          env={"PYTHONPATH": os.pathsep.join(sys.path)})
    assert restarted.returncode == 0, restarted.stderr
    assert "the DataLoader worker process (pid " in restarted.stderr, restarted.stderr
    assert "was killed by SIGKILL" in restarted.stderr and "starting the workers again (restart 1 of 1)" in restarted.stderr
    # (whether it died before or after the first checkpoint depends on how far ahead the worker read:
    # either way the restarted run ends bitwise where the uninterrupted one does)
    expected = emulated(tmp_path, *common, env={"PYTHONPATH": os.pathsep.join(sys.path)})
    got = torch.load(tmp_path / "restarted.pt")
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def _in_small_tmpfs(size: str, script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``script`` (sh) run with a fresh tmpfs of ``size`` mounted at $MNT, in a user and mount
    namespace of its own: a real full disk, without root."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("mounting a small tmpfs needs unshare with user namespaces")
    mount = f'MNT=$(mktemp -d) && mount -t tmpfs -o size={size} tmpfs "$MNT" && export MNT && '
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount + script],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_a_full_disk_stops_every_rank_with_one_line_and_leaves_nothing_behind(tmp_path):
    command = " ".join([sys.executable, "-m", "pipetrain.cli", "train", *BASE, "--model", "mlp:depth=3,width=256",
                        "--schedule", "pipedream", "--stages", "2", "--steps", "6", "--checkpoint-every", "2",
                        "--quiet", "--timeout", "20"])
    # a checkpoint takes 1.4 MB: the first fits in 2 MB, the second (the first still kept) does not
    full = _in_small_tmpfs("2m", f'{command} --keep 1 --checkpoint-dir "$MNT/ck"; echo "status $?"; '
                                 'cd "$MNT/ck" && find . | sort && ' + sys.executable + ' -c "import sys; from '
                                 'pipetrain.runtime.checkpoint import open_checkpoint as o; '
                                 'print(\'verified step\', o(sys.argv[1]).step)" step-000002')
    lines = full.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("status "))
    assert lines[at] == "status 2", full.stdout + full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("pipetrain train: error: checkpoint of step 4 failed on rank "), full.stderr
    assert "/ck/step-000004/rank-" in last and last.endswith(": No space left on device"), full.stderr
    assert "Traceback" not in full.stderr and "enforce fail" not in full.stderr
    # the older checkpoint intact (its files all there), nothing of the failed one, no temporary
    assert lines[at + 1:-1] == [".", "./step-000002", "./step-000002/manifest.json", "./step-000002/rank-0.pt",
                                "./step-000002/rank-1.pt"]
    assert lines[-1] == "verified step 2"  # sizes and SHA-256 checked

    # --save on a full disk: the trained weights stay in the run's last checkpoint, and it says so
    saved = _in_small_tmpfs("256k", f'{command} --checkpoint-dir {tmp_path / "ck"} --save "$MNT/model.pt"; '
                                    'echo "status $?"; ls -a "$MNT"')
    assert "status 2\n.\n..\n" in saved.stdout, saved.stdout + saved.stderr  # no model.pt, no temporary
    assert saved.stderr.count("\n") == 1 and "Traceback" not in saved.stderr, saved.stderr
    assert saved.stderr.startswith("pipetrain train: error: cannot write --save ") and (
        "/model.pt: No space left on device; the trained weights are kept in the run's last checkpoint, "
        f"{tmp_path / 'ck' / 'step-000006'}") in saved.stderr, saved.stderr


def _tree(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (links not followed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_linked_step_directory_is_refused_and_nothing_is_written_through_it(tmp_path):
    outside = tmp_path / "another-run" / "step-000010"  # a checkpoint of another run, where the link points
    outside.mkdir(parents=True)
    (outside / "manifest.json").write_text('{"format": 1, "step": 10, "files": []}')
    (outside / "rank-0.pt").write_bytes(b"another run's state")
    before = _tree(tmp_path / "another-run")
    directory = tmp_path / "ck"
    directory.mkdir()
    (directory / "step-000010").symlink_to(outside, target_is_directory=True)
    result = pipetrain("--schedule", "pipedream", "--stages", "2", "--steps", "20", "--checkpoint-dir", str(directory),
                       "--checkpoint-every", "10")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"pipetrain train: error: cannot write checkpoint {directory / 'step-000010'}: it is a "
                             "symbolic link, and pipetrain writes checkpoints only into step directories of its own, "
                             "never through links; remove the link, or give the run another --checkpoint-dir\n")
    assert _tree(tmp_path / "another-run") == before  # nothing created, written or renamed there
    assert sorted(p.name for p in directory.iterdir()) == ["step-000010"]  # the lock released, the link left alone


def test_a_linked_lock_file_is_refused_in_one_line_and_left_untouched(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("not a lock")
    directory = tmp_path / "ck"
    directory.mkdir()
    (directory / ".pipetrain-lock").symlink_to(target)
    result = pipetrain("--schedule", "1f1b", "--stages", "2", "--steps", "4", "--checkpoint-dir", str(directory))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"pipetrain train: error: cannot lock checkpoint directory {directory}: its lock file "
                             ".pipetrain-lock is a symbolic link, which pipetrain never writes through; remove it, "
                             "or give this run another --checkpoint-dir\n")
    assert target.read_text() == "not a lock" and (directory / ".pipetrain-lock").is_symlink()


def test_save_dir_on_a_full_disk_is_one_line_and_leaves_no_shard(tmp_path):
    # stage 0 holds three 256x256 layers (530 KB), stage 1 the last one (3 KB): its shard fits in 256 KB
    command = " ".join([sys.executable, "-m", "pipetrain.cli", "train", *BASE, "--model", "mlp:depth=3,width=256",
                        "--schedule", "pipedream", "--balance", "3,1", "--steps", "2", "--quiet", "--timeout", "20"])
    saved = _in_small_tmpfs("256k", f'{command} --save "$MNT/model"; echo "status $?"; cd "$MNT" && find . | sort')
    lines = saved.stdout.splitlines()
    at = lines.index("status 2") if "status 2" in lines else None
    assert at is not None, saved.stdout + saved.stderr
    assert [line for line in lines[at + 1:] if line not in (".", "./model")] == [], saved.stdout  # no shard, no temporary
    assert saved.stderr.count("\n") == 1 and "Traceback" not in saved.stderr, saved.stderr
    assert saved.stderr.startswith("pipetrain train: error: cannot write --save "), saved.stderr
    assert saved.stderr.endswith("/model/model-00001-of-00002.safetensors: No space left on device; the trained "
                                 "weights were not written anywhere else\n"), saved.stderr


def _killed_while_the_other_sets_up():
    import torch.distributed  # noqa: F401  (the start-up cost of a real worker)

    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # rank 0 builds its model, measures its stages: it communicates with no one for a while


def test_a_rank_killed_while_the_others_set_up_gives_them_a_short_grace(capfd):
    from pipetrain.runtime.launch import launch

    result = launch(_killed_while_the_other_sets_up, (), 2, timeout=120)  # the default grace: 5 s
    assert result.returncode == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert "worker rank 1 was killed by SIGKILL" in err
    # its peers could only echo its loss: they get the short grace of a restart, not 5 s
    assert "rank(s) 0 still running 1 s later: terminating them" in err, err


def _dies_while_rank_1_waits_for_the_unit_times(config):
    from pipetrain.runtime.launch import init_distributed
    from pipetrain.runtime.status import env_store

    env = init_distributed("gloo", timeout=30)
    store = env_store()
    if env.rank == 1:
        store.set("preparing", "1")
        prepare(config)  # cut by time: rank 0 measures, then broadcasts the unit times
    else:
        store.wait(["preparing"])
        time.sleep(5)  # rank 1 waits in the broadcast by now
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_that_dies_during_set_up_leaves_its_peer_one_line(capfd):
    from pipetrain.runtime.launch import launch

    config = TrainConfig(model="mlp:depth=5,width=16", data="synthetic:features=8,classes=3,samples=96",
                         batch_size=12, schedule="1f1b", stages=2, balance_by="time", executor="distributed")
    result = launch(_dies_while_rank_1_waits_for_the_unit_times, (config,), 2, timeout=120)
    err = capfd.readouterr().err
    assert result.returncode == 128 + signal.SIGKILL, err
    assert result.exitcodes[1] == 3, err  # a lost peer, not an internal error (1)
    assert "Traceback" not in err, err
    assert "pipetrain worker rank 1: error: rank 1: sharing the measured unit times failed because a peer is gone " \
           "or stuck (" in err, err


def _stopped_while_its_peer_computes(seconds):
    from pipetrain.runtime.launch import init_distributed
    from pipetrain.runtime.status import StatusBoard

    env = init_distributed("gloo", timeout=60)
    board = StatusBoard.from_env()
    if env.rank == 1:
        board.publish()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(seconds)  # rank 0 computes: it waits for no one, so no wait of its own would time out


def test_a_stopped_rank_is_killed_when_its_board_is_silent_for_the_timeout(capfd):
    from pipetrain.runtime.launch import launch

    started = time.monotonic()
    result = launch(_stopped_while_its_peer_computes, (120,), 2, timeout=150, silence=3)
    elapsed = time.monotonic() - started
    err = capfd.readouterr().err
    assert result.returncode == 3, err
    assert result.exitcodes == [-signal.SIGTERM, -signal.SIGKILL], err  # rank 0 was still computing
    assert elapsed < 100, err  # not the end of rank 0's computation
    # measured from when its board last published, not from any peer's wait: no peer waited
    said = next(line for line in err.splitlines() if "rank 1 fell silent " in line)
    assert float(said.split("fell silent ")[1].split(" s ago")[0]) >= 3, said
    assert "longer than timeout=3: it is stopped (SIGSTOP, for instance) or frozen; killed it (SIGKILL)" in said
    assert result.message.startswith("rank 1 fell silent "), result.message
