"""Devices: the ``--device`` choice, and the device-generic paths (a batch, a message, labels, a
checkpoint's tensors coming to the stage's device) run here with an explicit CPU device."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.cli import main
from pipetrain.errors import ConfigError
from pipetrain.execution import StageExecutor
from pipetrain.execution.device import DEVICES, resolve_device, to_device
from pipetrain.optim import SGD

CPU = torch.device("cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")


def test_the_names_known_without_pytorch_are_those_of_the_set_up():
    from pipetrain.training.run import AUTOCAST
    from pipetrain.training.validate import DEVICES as checked, PRECISIONS

    assert checked == DEVICES and tuple(AUTOCAST) == PRECISIONS


def test_cpu_and_auto_resolve_to_the_cpu_without_cuda():
    assert resolve_device("cpu") == CPU
    if not torch.cuda.is_available():
        assert resolve_device("auto") == CPU
    with pytest.raises(ConfigError, match="choose one of auto, cpu, cuda"):
        resolve_device("tpu")


@no_cuda
def test_cuda_where_there_is_none_is_one_clear_message(capsys):
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        resolve_device("cuda")
    assert main(["train", "--executor", "emulate", "--device", "cuda", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: CUDA is not available" in err and "--device cpu" in err


def test_to_device_moves_nested_values_and_leaves_tensors_already_there():
    Pair = namedtuple("Pair", "x y")
    x, y = torch.randn(2), torch.arange(3)
    moved = to_device({"a": (x, [y, 3]), "b": Pair(x, "text")}, CPU)
    assert moved["a"][0] is x and moved["a"][1][0] is y and moved["a"][1][1] == 3
    assert isinstance(moved["b"], Pair) and moved["b"].x is x and moved["b"].y == "text"
    assert to_device(torch.zeros(2, dtype=torch.float64), torch.device("meta")).device.type == "meta"


def test_a_stage_computes_where_its_parameters_are_and_brings_its_inputs_there():
    torch.manual_seed(0)
    module = nn.Linear(4, 3).to(CPU)
    executor = StageExecutor(1, module, SGD(lr=0.1, momentum=0.9), loss_fn=F.cross_entropy)
    assert executor.device == CPU
    executor.forward(0, 0, torch.randn(2, 4), target=torch.tensor([0, 2]), samples=2)
    executor.backward(0, 0)
    executor.step()
    assert all(t.device == CPU for t in executor.versions.latest.values())
    buffers = [t for entry in executor.optimizer.state_dict()["state"].values() for t in entry.values()]
    assert len(buffers) == 2 and all(t.device == CPU for t in buffers)  # momentum made from the gradients


def test_a_checkpointed_stage_resumes_on_the_device_of_the_resuming_run():
    torch.manual_seed(0)
    saved = StageExecutor(1, nn.Linear(4, 3), SGD(lr=0.1, momentum=0.9), loss_fn=F.cross_entropy)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    saved.forward(0, 0, x, target=y, samples=2)
    saved.backward(0, 0)
    saved.step()
    saved.forward(1, 1, x, target=y, samples=2)  # in flight at the checkpoint
    state = saved.snapshot()
    torch.manual_seed(1)
    resumed = StageExecutor(1, nn.Linear(4, 3).to(CPU), SGD(lr=0.1, momentum=0.9), loss_fn=F.cross_entropy)
    resumed.restore(state)
    for executor in (saved, resumed):
        executor.backward(1, 1)
        executor.step()
    for name, value in saved.versions.latest.items():
        assert resumed.versions.latest[name].device == CPU
        assert torch.equal(value, resumed.versions.latest[name]), name


def test_a_run_places_its_stages_on_its_device():
    from pipetrain.training import TrainConfig
    from pipetrain.training.setup import prepare

    run = prepare(TrainConfig(model="mlp:depth=3,width=8", data="synthetic:features=4,classes=2,samples=16",
                              batch_size=4, steps=1, stages=2, executor="emulate", device="cpu", progress=False))
    assert run.device == CPU
    assert [e.device for rank in run.make_executors() for e in rank.values()] == [CPU, CPU]


def test_a_stage_without_parameters_computes_on_the_device_it_is_given():
    executor = StageExecutor(1, nn.Tanh(), None, device=CPU)
    assert executor.device == CPU
    x = torch.randn(2, 3)
    assert torch.equal(executor.forward(0, 0, x)[0], torch.tanh(x))
    assert executor.backward(0, 0, (torch.ones(2, 3),))[0].shape == (2, 3)
