"""`pipetrain train` under torchrun: two agents (two "machines") meeting at a c10d rendezvous on
127.0.0.1 train to the emulator's parameters, also when a worker is killed and torchrun restarts
them (they resume from the checkpoints by themselves); a killed agent ends the other one."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import torchrun_agents

from pipetrain.errors import ConfigError
from pipetrain.training import TrainConfig, prepare
from pipetrain.training.train import train

OPTIONS = ["--schedule", "1f1b", "--stages", "2", "--model", "mlp:depth=3,width=16",
           "--data", "synthetic:features=8,classes=3,samples=64", "--batch-size", "8", "--steps", "8",
           "--microbatches", "2", "--no-progress", "--timeout", "30"]
SCRIPT = os.path.join(os.path.dirname(__file__), "restart_script.py")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _same(a, b) -> bool:
    a, b = torch.load(a), torch.load(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_torchrun_agents_restart_a_killed_worker_and_train_like_the_emulator(tmp_path):
    saved = tmp_path / "torchrun.pt"
    config = TrainConfig(schedule="1f1b", stages=2, model="mlp:depth=3,width=16", microbatches=2,
                         data="synthetic:features=8,classes=3,samples=64", batch_size=8, steps=8,
                         executor="emulate", progress=False, save=str(tmp_path / "emulated.pt"))
    rank = random.randrange(2)
    position = random.randrange(1, len(prepare(config).schedule.programs[rank]))
    codes, text = torchrun_agents.run(
        ["-m", "pipetrain.cli", "train", "--executor", "distributed", *OPTIONS, "--save", str(saved),
         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"], rdzv_id="pipetrain-train", restarts=1,
        env={"PIPETRAIN_FAULT_INJECT": f"{rank}:{position}"})
    where = f"rank {rank} killed before position {position}"
    assert codes == [0, 0], (where, text)
    assert "1f1b: 8 steps on 2 workers" in text
    assert "no checkpoint in" in text and text.count("resuming from step") + text.count("no checkpoint in") == 2, text
    train(config)
    assert _same(saved, config.save), where


def test_a_script_under_torchrun_restarts_and_resumes_every_run_exactly(tmp_path):
    import restart_script

    kill = f"{random.choice(list(restart_script.RUNS))}:{random.randrange(restart_script.RUNS['1f1b']['steps'] - 1)}"
    codes, text = torchrun_agents.run([SCRIPT, str(tmp_path), "--kill", kill], rdzv_id="pipetrain-train", restarts=1)
    assert codes == [0, 0], (kill, text)
    restart_script.main([str(tmp_path), "--executor", "emulate"])
    for schedule in restart_script.RUNS:
        assert _same(tmp_path / f"{schedule}.pt", tmp_path / f"{schedule}-emulated.pt"), (kill, schedule)


@pytest.mark.parametrize("victim", [0, 1], ids=["the rendezvous host", "the other agent"])
def test_killing_either_agent_ends_the_other_one_non_zero(tmp_path, victim):
    logs = [open(tmp_path / f"agent{node}.log", "w") for node in (0, 1)]
    long_run = OPTIONS[:OPTIONS.index("--steps")] + ["--steps", "4000"] + OPTIONS[OPTIONS.index("--steps") + 2:]
    procs = torchrun_agents.start(["-m", "pipetrain.cli", "train", "--executor", "distributed", *long_run],
                                  rdzv_id="pipetrain-train", outputs=logs)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("stage 0:" in (tmp_path / f"agent{n}.log").read_text()
                                                      for n in (0, 1)):
            time.sleep(0.2)
        time.sleep(2.0)  # training
        assert all(p.poll() is None for p in procs), "the run ended before the agent was killed"
        orphans = _children(procs[victim].pid)  # its worker: it must not go on training alone
        assert orphans
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[1 - victim].wait(timeout=120)
        elapsed = time.monotonic() - killed
        while time.monotonic() - killed < 10 and any(os.path.exists(f"/proc/{pid}") for pid in orphans):
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in orphans)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert code != 0
    assert elapsed < 30 + 15, elapsed  # --timeout plus the grace torchrun takes to stop (docs/runtime-io.md)


def test_max_restarts_is_torchruns_own_under_torchrun(monkeypatch):
    from pipetrain.training.distributed import refuse_restarts_here

    for key, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                           TORCHELASTIC_RUN_ID="job").items():
        monkeypatch.setenv(key, value)
    own = r"^max_restarts restarts the workers that pipetrain itself starts; under torchrun give torchrun its own"
    with pytest.raises(ConfigError, match=own + r" limit \(torchrun's max-restarts option") as refused:
        refuse_restarts_here(TrainConfig(max_restarts=1))
    assert refused.value.options == ("max_restarts", "checkpoint_dir")
    refuse_restarts_here(TrainConfig())
