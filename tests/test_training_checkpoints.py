"""Where a distributed run checkpoints and resumes (pipetrain.training.checkpoints): every schedule
resumes to the parameters of the uninterrupted run, bitwise; --checkpoint-dir alone resumes or
starts afresh; the last step is checkpointed; checkpoints that do not fit the run are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.runtime.checkpoint import list_checkpoints
from pipetrain.runtime.launch import launch
from pipetrain.training import TrainConfig, prepare
from pipetrain.training.checkpoints import checkpoint_period
from pipetrain.training.train import train

BASE = dict(model="mlp:depth=6,width=16", data="synthetic:features=8,classes=3,samples=96", batch_size=12, steps=9,
            executor="distributed", progress=False, quiet=True, timeout=60)
#: every schedule on 3 workers, resumed from its checkpoint of step RESUME (the newest but one)
SCHEDULES = {
    "gpipe": dict(schedule="gpipe", stages=3, microbatches=3),
    "1f1b": dict(schedule="1f1b", stages=3, microbatches=3),
    "interleaved": dict(schedule="interleaved", stages=3, chunks=2, microbatches=3),
    "zb-h1": dict(schedule="zb-h1", stages=3, microbatches=3),
    "pipedream": dict(schedule="pipedream", stages=3),
    "pipedream-vsync": dict(schedule="pipedream", stages=3, policy="vsync"),
    "2bw": dict(schedule="2bw", stages=3, microbatches=3),
    "pb": dict(schedule="pb", stages=3, batch_size=1, steps=30, checkpoint_every=4),
    "pb-sc": dict(schedule="pb", stages=3, batch_size=1, steps=30, compensation="sc", checkpoint_every=7),
    "pb-lwp": dict(schedule="pb", stages=3, batch_size=1, steps=30, compensation="lwp", checkpoint_every=5),
    "pipedream-replicated": dict(schedule="pipedream", stages=2, replicas=[2, 1], steps=12),
}


def _each(runs):
    """Worker entry: run ``(config, error file)`` pairs in one process group; a PipetrainError
    (raised by every rank alike) is written to the error file by rank 0 and the next run starts."""
    from pipetrain.training.distributed import worker

    for config, errors in runs:
        try:
            worker(config)
        except PipetrainError as error:
            if errors is None:
                raise
            if int(os.environ["RANK"]) == 0:
                with open(errors, "w") as handle:
                    handle.write(str(error))


def _equal(a: str, b: str) -> bool:
    first, second = torch.load(a), torch.load(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_every_schedule_resumes_to_the_uninterrupted_parameters(tmp_path):
    runs, expected, full = [], {}, {}
    for name, options in SCHEDULES.items():
        config = TrainConfig(**dict(BASE, **options), checkpoint_dir=str(tmp_path / name), save=str(tmp_path / f"{name}.pt"))
        period = checkpoint_period(prepare(config))
        resume = [*range(period, config.steps, period), config.steps][-2]  # the newest but one: microbatches in flight
        full[name] = config
        resumed = dataclasses.replace(config, checkpoint_dir=str(tmp_path / f"{name}-resumed"),
                                      resume=str(tmp_path / name / f"step-{resume:06d}"),
                                      save=str(tmp_path / f"{name}-resumed.pt"))
        runs += [(config, None), (resumed, None)]
        expected[name] = dataclasses.replace(config, executor="emulate", checkpoint_dir=None, checkpoint_every=0,
                                             save=str(tmp_path / f"{name}-emulated.pt"))
    # a finished run started again resumes from its end (the last step is checkpointed) and saves the
    # same model; a checkpoint past a run's end, or from a run whose pipeline drains elsewhere, is refused
    again = dataclasses.replace(full["pb"], save=str(tmp_path / "pb-again.pt"))  # --checkpoint-dir alone
    shorter = dataclasses.replace(again, steps=20, save=None)
    longer = dataclasses.replace(full["pipedream"], steps=18, checkpoint_dir=str(tmp_path / "pipedream-longer"),
                                 save=None, resume=str(tmp_path / "pipedream" / "step-000009"))
    runs += [(again, None), (shorter, str(tmp_path / "shorter.txt")), (longer, str(tmp_path / "longer.txt"))]
    result = launch(_each, (runs,), nprocs=3, timeout=600, quiet=True)
    assert result.returncode == 0, result.message
    for name, config in expected.items():
        train(config)
        assert _equal(str(tmp_path / f"{name}.pt"), config.save), name
        assert _equal(str(tmp_path / f"{name}-resumed.pt"), config.save), name
    assert _equal(str(tmp_path / "pb-again.pt"), str(tmp_path / "pb.pt"))
    # default period: a tenth of the run; the newest two kept, the last step among them
    assert [step for step, _ in list_checkpoints(tmp_path / "pipedream")] == [8, 9]
    assert [step for step, _ in list_checkpoints(tmp_path / "pb")] == [28, 30]
    assert (tmp_path / "shorter.txt").read_text() == (
        f"checkpoint {tmp_path / 'pb' / 'step-000030'} is at step 30, past the end of this run (20 steps): resume "
        "with steps=30 or more, or start afresh with another checkpoint_dir")
    text = (tmp_path / "longer.txt").read_text()
    assert "the checkpoint of step 9 holds microbatches [] of stage 0 in flight, where this run's program has [9, 10]" in text
    assert "a run of another length" in text


def test_the_default_period_is_a_tenth_of_the_run_and_fits_replicas():
    def period(**options):
        return checkpoint_period(prepare(TrainConfig(**dict(BASE, **options))))

    assert period(schedule="1f1b", stages=2, steps=45, checkpoint_dir="d") == 5
    assert period(schedule="1f1b", stages=2, steps=7, checkpoint_dir="d") == 1
    assert period(schedule="1f1b", stages=2, steps=45, checkpoint_dir="d", checkpoint_every=4) == 4
    assert period(schedule="1f1b", stages=2, steps=45) == 0  # no --checkpoint-dir: no checkpoints
    # replicas [2, 1] under pipedream update together over pairs of minibatches: odd steps cannot be cut
    assert period(schedule="pipedream", stages=2, replicas=[2, 1], steps=30, checkpoint_dir="d") == 4


def test_a_restart_without_checkpoints_says_it_trains_again_naming_the_option_as_the_user_does(capsys):
    from pipetrain.errors import naming_options_as
    from pipetrain.training.checkpoints import Checkpoints

    run = prepare(TrainConfig(**dict(BASE, schedule="1f1b", stages=2, quiet=False)))
    assert Checkpoints(run, 0, 2).resume_point(restart=1) is None
    with naming_options_as("flag"):
        assert Checkpoints(run, 0, 2).resume_point(restart=2) is None
    assert capsys.readouterr().out.splitlines() == [
        "restart 1 without checkpoint_dir: training again from step 0",
        "restart 2 without --checkpoint-dir: training again from step 0"]


def test_checkpoint_options_are_checked_before_any_work(tmp_path):
    from pipetrain.errors import naming_options_as
    from pipetrain.training.validate import check_config

    with naming_options_as("flag"):  # as `pipetrain train` says it
        with pytest.raises(ConfigError, match="--keep must be at least 1"):
            check_config(TrainConfig(checkpoint_dir=str(tmp_path), keep=0))
        with pytest.raises(ConfigError, match="--extend continues the run of a checkpoint: give --checkpoint-dir"):
            check_config(TrainConfig(extend=True))
        with pytest.raises(ConfigError, match="--max-restarts must be at least 0"):
            check_config(TrainConfig(max_restarts=-1))
        with pytest.raises(ConfigError, match="--max-restarts restarts the workers of the distributed runtime"):
            check_config(TrainConfig(executor="emulate", max_restarts=1))
        (tmp_path / "file").write_text("")
        with pytest.raises(ConfigError, match="--checkpoint-dir"):  # checked without --checkpoint-every too
            check_config(TrainConfig(checkpoint_dir=str(tmp_path / "file")))
    assert json.loads(json.dumps(TrainConfig().fingerprint()))  # keep and max_restarts do not enter it
    assert "keep" not in TrainConfig().fingerprint() and "max_restarts" not in TrainConfig().fingerprint()


def test_a_checkpoint_resumes_on_the_device_of_the_resuming_run(tmp_path, capsys):
    """A checkpoint of a run under ``--device auto`` resumes under ``--device cpu``; so does one
    whose tensors were saved on a GPU (its files say ``cuda:0``); one holding tensors without data
    (PyTorch's 'meta' device), which no device can take, is refused by every worker alike: one
    line, exit status 2."""
    import shutil

    from checkpoint_files import claim_device, reseal

    from pipetrain.cli import main
    from pipetrain.execution.device import to_device
    from pipetrain.runtime.checkpoint import open_checkpoint, save_checkpoint

    options = dict(BASE, schedule="pipedream", stages=2, steps=6, checkpoint_every=3)
    full = TrainConfig(**options, device="auto", checkpoint_dir=str(tmp_path / "full"), save=str(tmp_path / "full.pt"))
    train(full)
    step = tmp_path / "full" / "step-000003"
    gpu = tmp_path / "gpu" / step.name
    shutil.copytree(step, gpu)
    for name in open_checkpoint(gpu).files:
        claim_device(gpu / name, "cuda:0")
    reseal(gpu)
    runs = [(dataclasses.replace(full, device="cpu", resume=str(source), checkpoint_dir=str(tmp_path / f"{tag}-resumed"),
                                 save=str(tmp_path / f"{tag}-resumed.pt")), None)
            for tag, source in (("auto", step), ("gpu", gpu))]
    result = launch(_each, (runs,), nprocs=2, timeout=300, quiet=True)
    assert result.returncode == 0, result.message
    for config, _ in runs:
        assert _equal(config.save, full.save), config.resume

    checkpoint = open_checkpoint(step)
    states = {name: checkpoint.load(name) for name in checkpoint.files}
    states["rank-1.pt"]["stages"][1]["versions"] = to_device(states["rank-1.pt"]["stages"][1]["versions"],
                                                            torch.device("meta"))
    empty = save_checkpoint(tmp_path / "meta", 3, states, checkpoint.meta)
    capsys.readouterr()
    code = main(["train", "--model", options["model"], "--data", options["data"], "--batch-size", "12", "--steps", "6",
                 "--schedule", "pipedream", "--stages", "2", "--device", "cpu", "--resume", str(empty),
                 "--checkpoint-dir", str(tmp_path / "meta-resumed"), "--no-progress", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"pipetrain train: error: checkpoint {empty}: rank-1.pt holds tensors without data, on "
                          "PyTorch's 'meta' device (stages/1/versions/"), err


@pytest.mark.parametrize("options", [dict(schedule="pipedream", stages=2),
                                     dict(schedule="2bw", stages=2, microbatches=2)])
def test_extend_continues_a_finished_asynchronous_run_and_says_so(tmp_path, options):
    base = dict(BASE, **options, steps=6, checkpoint_every=3, checkpoint_dir=str(tmp_path / "ck"))
    first = TrainConfig(**base)
    longer = dataclasses.replace(first, steps=10)
    extended = dataclasses.replace(longer, extend=True, save=str(tmp_path / "extended.pt"),
                                   report_json=str(tmp_path / "extended.json"))
    runs = [(first, None), (longer, str(tmp_path / "refused.txt")), (extended, None),
            (longer, str(tmp_path / "without.txt"))]  # the extended run's checkpoint, resumed without --extend
    result = launch(_each, (runs,), nprocs=2, timeout=300, quiet=True)
    assert result.returncode == 0, result.message
    refused = (tmp_path / "refused.txt").read_text()
    assert "a run of another length (steps / epochs)" in refused and "by turning on extend, which drains" in refused
    assert (tmp_path / "without.txt").read_text() == (
        f"checkpoint {tmp_path / 'ck' / 'step-000010'} is of a run extended with extend (its pipeline drained "
        "after update 6): to resume it, turn on extend too")
    data = json.loads((tmp_path / "extended.json").read_text())["data"]
    assert data.endswith(f"; extends the run of {tmp_path / 'ck' / 'step-000006'}: its pipeline drained after update "
                         "6, so this is not the uninterrupted 10-update run"), data
    # the extended run is the 6-update run, drained, then 4 more: the emulator runs that schedule whole
    reference = dataclasses.replace(longer, executor="emulate", checkpoint_dir=None, checkpoint_every=0,
                                    drain_at=(6,), save=str(tmp_path / "drained.pt"))
    train(reference)
    assert _equal(str(tmp_path / "extended.pt"), reference.save)
    uninterrupted = dataclasses.replace(reference, drain_at=(), save=str(tmp_path / "uninterrupted.pt"))
    train(uninterrupted)
    assert not _equal(str(tmp_path / "extended.pt"), uninterrupted.save)  # it is not the longer run


NETS = '''
import torch
from torch import nn


def net(in_features, num_classes, depth={depth}):
    torch.manual_seed(0)
    layers = [nn.Linear(in_features, 16), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, num_classes))
'''


def test_a_checkpoint_of_another_model_is_refused_as_such_saying_how_to_tell(tmp_path, monkeypatch, capfd):
    # the run cuts by measured time, and resumes with the checkpoint's times: those of another model's modules
    from pipetrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mynets.py").write_text(NETS.format(depth=1))
    run = ["train", "--data", "synthetic:features=8,classes=3,samples=96", "--stages", "2", "--batch-size", "12",
           "--no-progress", "--quiet", "--timeout", "60", "--checkpoint-dir", "ck"]
    assert main([*run, "--model", "mynets:net", "--steps", "2"]) == 0, capfd.readouterr().err
    capfd.readouterr()
    assert main([*run, "--model", "mynets:net:depth=2", "--steps", "4"]) == 2
    err = capfd.readouterr().err
    assert err.endswith("error: checkpoint ck/step-000002 is of another model: written by a run of --model mynets:net, "
                        "not --model mynets:net:depth=2 (its manifest.json names the model under \"model\"); resume "
                        "it with the model it was written for, or start afresh with another --checkpoint-dir\n"), err
    (tmp_path / "mynets.py").write_text(NETS.format(depth=2))  # the same --model, its code changed
    monkeypatch.delitem(sys.modules, "mynets")  # as a new command would import it
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    assert main([*run, "--model", "mynets:net", "--steps", "4"]) == 2
    err = capfd.readouterr().err
    assert err.endswith("error: checkpoint ck/step-000002 is of another model: its run timed the modules 0, 1, 2, 3, "
                        "... to cut the model (its manifest.json lists them under \"stage_costs\"), which are not "
                        "this model's: the model changed since it was written; resume it with the model it was "
                        "written for, or start afresh with another --checkpoint-dir\n"), err
    assert "unit costs" not in err
