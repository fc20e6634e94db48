"""`pipetrain profile`: a real built-in model measured and planned."""

from __future__ import annotations

import json

from pipetrain.cli import main


def test_profile_then_plan(capsys, tmp_path):
    out = tmp_path / "mlp.json"
    code = main(["profile", "--model", "mlp:depth=3,width=32", "--data", "digits",
                 "--batch-size", "16", "--iterations", "1", "--warmup", "0", "--out", str(out),
                 "--no-progress"])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "wrote profile to" in text
    data = json.loads(out.read_text())
    assert data["format"] == "pipetrain-profile" and data["batch_size"] == 16
    names = [layer["name"] for layer in data["layers"]]
    assert names == ["input", "0", "1", "2", "3"]
    assert data["layers"][1]["parameter_bytes"] == (64 * 32 + 32) * 4
    code = main(["plan", str(out), "--workers", "2", "--straight", "--json"])
    plan = json.loads(capsys.readouterr()[0])
    assert code == 0 and sum(plan["balance"]) == 4 and len(plan["split_at"]) == 1


def test_profile_errors(capsys):
    assert main(["profile", "--model", "nosuchmodel", "--data", "digits"]) == 2
    assert "unknown model" in capsys.readouterr()[1]
    assert main(["profile", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr()[1]
