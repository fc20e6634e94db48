"""`pipetrain train` under torchrun: two agents (two "machines") meeting at a c10d rendezvous on
127.0.0.1 train to the emulator's parameters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

from pipetrain.training import TrainConfig
from pipetrain.training.train import train

OPTIONS = ["--schedule", "1f1b", "--stages", "2", "--model", "mlp:depth=3,width=16",
           "--data", "synthetic:features=8,classes=3,samples=64", "--batch-size", "8", "--steps", "4",
           "--no-progress", "--timeout", "60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_train_like_the_emulator(tmp_path):
    port = _free_port()
    saved = tmp_path / "torchrun.pt"
    procs = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipetrain-train",
            "--rdzv-conf", f"is_host={1 - node},join_timeout=90", "--max-restarts", "0",
            "-m", "pipetrain.cli", "train", "--executor", "distributed", *OPTIONS, "--save", str(saved),
        ]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert "1f1b: 4 steps on 2 workers" in "\n".join(outputs)
    config = TrainConfig(schedule="1f1b", stages=2, model="mlp:depth=3,width=16",
                         data="synthetic:features=8,classes=3,samples=64", batch_size=8, steps=4,
                         executor="emulate", progress=False, save=str(tmp_path / "emulated.pt"))
    train(config)
    a, b = torch.load(saved), torch.load(tmp_path / "emulated.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
