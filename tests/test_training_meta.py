"""Training a model built on the meta device: each rank materialises its own stages.

Given the same initial weights (a weights directory), a model built on meta trains bitwise like
the eagerly built one, on a synchronous and an asynchronous schedule, on the emulator and on the
runtime, and so does an eagerly built one given the directory's values (``--init eager --init-from``);
``--save DIR`` written stage by stage by the workers equals the emulator's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from distributed_parity import assert_distributed_equals_emulated

from pipetrain import Pipeline, load_weights
from pipetrain.errors import ConfigError
from pipetrain.initialiser import Init
from pipetrain.stages.materialize import has_meta
from pipetrain.models import build_model
from pipetrain.models.gpt import GPT
from pipetrain.training import TrainConfig
from pipetrain.training.parts import parts_from_config
from pipetrain.training.train import train
from pipetrain.weights import save_weights

MODEL = "gpt:n_layer=4,n_embd=16,n_head=2"
DATA = "text:block_size=12"
BASE = dict(model=MODEL, data=DATA, batch_size=8, steps=3, optimizer="sgd:lr=0.05,momentum=0.9", progress=False,
            quiet=True, eval_samples=16, balance_by="params", timeout=60.0)
SCHEDULES = {"1f1b": {"microbatches": 2}, "pipedream": {}}


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    """The eager model's initial weights (as the command line builds it, under --seed 0)."""
    directory = tmp_path_factory.mktemp("initial") / "weights"
    model = build_model(MODEL, input_shape=(12,), num_classes=96, seed=0)
    save_weights(directory, [model.state_dict()])
    return str(directory)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_meta_model_from_the_initial_weights_trains_like_the_eager_one(tmp_path, initial, schedule):
    options = {**BASE, **SCHEDULES[schedule], "schedule": schedule, "stages": 2, "executor": "emulate"}
    eager = TrainConfig(**options, save=str(tmp_path / "eager.pt"))
    meta = TrainConfig(**options, init=initial, save=str(tmp_path / "meta.pt"))
    assert not has_meta(parts_from_config(eager).model) and has_meta(parts_from_config(meta).model)
    train(eager)
    train(meta)
    a, b = torch.load(eager.save), torch.load(meta.save)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_eagerly_built_model_started_from_the_directory_trains_like_the_meta_one(tmp_path, initial):
    """``--init eager --init-from DIR``: the model is built with values, which the directory's replace."""
    options = {**BASE, "schedule": "1f1b", "microbatches": 2, "stages": 2, "executor": "emulate", "seed": 5}
    eager = TrainConfig(**options, init=Init("weights", path=initial, on_meta=False), save=str(tmp_path / "eager.pt"))
    meta = TrainConfig(**options, init=initial, save=str(tmp_path / "meta.pt"))
    train(eager)
    train(meta)
    a, b = torch.load(eager.save), torch.load(meta.save)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

def test_the_runtime_equals_the_emulator_and_writes_the_same_weights_directory(tmp_path, initial):
    configs = [TrainConfig(**{**BASE, **extra}, schedule=schedule, stages=2, executor="distributed",
                           init=init, save=str(tmp_path / f"{schedule}-{init == 'reset'}-distributed.pt"))
               for schedule, extra in SCHEDULES.items() for init in (initial, "reset")]
    configs.append(TrainConfig(**BASE, schedule="1f1b", microbatches=1, stages=2, executor="distributed",
                               init="reset", save=str(tmp_path / "update-in-backward-distributed.pt")))
    assert_distributed_equals_emulated(configs, workers=2, timeout=240)
    common = ["--model", MODEL, "--data", DATA, "--steps", "3", "--batch-size", "8", "--stages", "2", "--init", "meta",
              "--balance-by", "params", "--quiet", "--eval-samples", "16"]
    for executor in ("distributed", "emulate"):
        done = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", *common, "--executor", executor,
                               "--save", str(tmp_path / executor)], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "distributed").iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    runtime = load_weights(GPT(96, 12, n_layer=4, n_head=2, n_embd=16), tmp_path / "distributed")
    emulator = load_weights(GPT(96, 12, n_layer=4, n_head=2, n_embd=16), tmp_path / "emulate")
    assert all(torch.equal(v, emulator.state_dict()[k]) for k, v in runtime.state_dict().items())


def test_reset_starts_every_stage_count_from_the_same_weights():
    def meta_gpt():
        with torch.device("meta"):
            return GPT(20, 8, n_layer=4, n_head=2, n_embd=16)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 20, (4, 8), generator=g), torch.randint(0, 20, (4, 8), generator=g))]
    trained = []
    for stages in (1, 2, 4):
        pipe = Pipeline(meta_gpt(), stages=stages, schedule="1f1b", microbatches=2, init="reset", executor="emulate",
                        optimizer="sgd:lr=0.1")
        pipe.train(batches)
        trained.append(pipe.state_dict())
    assert all(torch.equal(state[k], trained[0][k]) for state in trained[1:] for k in trained[0])


def test_a_meta_model_without_init_is_refused_in_one_line():
    with torch.device("meta"):
        model = GPT(20, 8, n_layer=2, n_head=2, n_embd=16)
    pipe = Pipeline(model, stages=2, executor="emulate")
    with pytest.raises(ConfigError, match="built on the meta device .* init='reset'"):
        pipe.train([(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))])
    with pytest.raises(ConfigError, match="has values already"):
        Pipeline(GPT(20, 8, n_layer=2, n_head=2, n_embd=16), stages=2, executor="emulate", init="reset").train(
            [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))])


def test_the_command_line_times_a_meta_model_unit_by_unit_and_refuses_a_missing_directory(tmp_path):
    common = [sys.executable, "-m", "pipetrain.cli", "train", "--model", MODEL, "--data", DATA, "--steps", "2",
              "--batch-size", "8", "--stages", "2", "--executor", "emulate"]
    done = subprocess.run([*common, "--init", "meta"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "stages balanced by measured time" in done.stdout
    refused = subprocess.run([*common, "--init-from", str(tmp_path / "none")], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "--init-from" in refused.stderr and "no such directory" in refused.stderr
    assert "Traceback" not in refused.stderr
