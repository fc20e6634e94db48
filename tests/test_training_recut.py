"""A synchronous run's checkpoint resumes on another cut, bitwise; an asynchronous one is refused."""

from __future__ import annotations

import subprocess
import sys

import torch

COMMON = ["--model", "mlp:depth=4,width=32", "--data", "synthetic:features=8,classes=3,samples=96", "--steps", "6",
          "--batch-size", "12", "--microbatches", "4", "--optimizer", "adam:lr=0.01", "--balance-by", "params",
          "--quiet", "--timeout", "60"]


def pipetrain(*argv):
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", *COMMON, *argv], capture_output=True,
                          text=True, timeout=240)


def test_a_1f1b_checkpoint_at_2_stages_resumes_at_4_like_the_uninterrupted_run(tmp_path):
    first = pipetrain("--schedule", "1f1b", "--stages", "2", "--checkpoint-dir", str(tmp_path / "a"),
                      "--checkpoint-every", "3")
    assert first.returncode == 0, first.stderr
    resumed = pipetrain("--schedule", "1f1b", "--stages", "4", "--checkpoint-dir", str(tmp_path / "b"),
                        "--resume", str(tmp_path / "a" / "step-000003"), "--save", str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr
    whole = pipetrain("--schedule", "1f1b", "--stages", "4", "--executor", "emulate", "--save", str(tmp_path / "whole.pt"))
    assert whole.returncode == 0, whole.stderr
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "whole.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    asynchronous = pipetrain("--schedule", "pipedream", "--stages", "2", "--checkpoint-dir", str(tmp_path / "c"),
                             "--checkpoint-every", "3")
    assert asynchronous.returncode == 0, asynchronous.stderr
    refused = pipetrain("--schedule", "pipedream", "--stages", "3", "--checkpoint-dir", str(tmp_path / "d"),
                        "--resume", str(tmp_path / "c" / "step-000003"))
    assert refused.returncode == 2
    assert "on another cut" in refused.stderr and "asynchronous schedule (version policy stash)" in refused.stderr
    assert "Traceback" not in refused.stderr
