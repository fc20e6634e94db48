"""Real models through the pipeline: a ResNet whose skips cross stage boundaries and a GPT, split
with torch.fx, train to the parameters of the unsplit model (emulator) and the runtime equals the
emulator, also with batches of varying sequence length."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from distributed_parity import assert_distributed_equals_emulated

from pipetrain import Pipeline
from pipetrain.data import get_batch, load_train_test
from pipetrain.models import build_model
from pipetrain.training import TrainConfig
from pipetrain.models.loss import cross_entropy


def plain(model, batches, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    for x, y in batches:
        opt.zero_grad()
        cross_entropy(model(x), y).backward()
        opt.step()


def resnet():
    train, _ = load_train_test("digits")
    model = build_model("resnet-gn-skip:channels=8", input_shape=(64,), num_classes=10, seed=0).double()
    batches = [get_batch(train, torch.arange(i * 8, i * 8 + 8)) for i in range(3)]
    return model, [(x.double(), y) for x, y in batches]


def gpt():
    train, _ = load_train_test("text:block_size=16")
    model = build_model("gpt:n_layer=3,n_embd=32,n_head=4", input_shape=(16,), num_classes=train.num_classes,
                        seed=0).double()
    return model, [get_batch(train, torch.arange(i * 4, i * 4 + 4)) for i in range(3)]


SPLITS = {
    "resnet": [["layer1.1"], ["layer1.1", "layer2.0.conv2"], ["layer1.0", "layer1.1", "layer2.0"]],
    "gpt": [["blocks.1"], ["blocks.1", "blocks.2.attn"], ["blocks.0.mlp", "blocks.1", "blocks.2"]],
}


@pytest.mark.parametrize("name, make", [("resnet", resnet), ("gpt", gpt)])
@pytest.mark.parametrize("split", [0, 1, 2])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_split_model_trains_like_the_unsplit_one(name, make, split, microbatches):
    model, batches = make()
    expected = copy.deepcopy(model)
    plain(expected, batches)
    pipe = Pipeline(model, executor="emulate", split_at=SPLITS[name][split], schedule="1f1b", microbatches=microbatches,
                    optimizer="sgd:lr=0.05,momentum=0.9")
    assert len(pipe.stages) == len(SPLITS[name][split]) + 1
    pipe.train(batches)
    for (key, p), q in zip(model.named_parameters(), expected.parameters()):
        if microbatches == 1:
            assert torch.equal(p, q), key
        else:
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=key)


def test_runtime_trains_real_models_like_the_emulator(tmp_path):
    base = dict(executor="distributed", progress=False, timeout=60.0, steps=3, optimizer="sgd:lr=0.05,momentum=0.9")
    configs = [
        TrainConfig(model="resnet-gn-skip:channels=8", data="digits", split_at=["layer1.1"], schedule="1f1b",
                    batch_size=8, microbatches=2, **base),
        TrainConfig(model="gpt:n_layer=2,n_embd=32", data="text:block_size=16,min_length=4", stages=2,
                    schedule="1f1b", batch_size=8, microbatches=2, **base),
        TrainConfig(model="gpt:n_layer=2,n_embd=32", data="text:block_size=16,min_length=4", stages=2,
                    schedule="pipedream", batch_size=4, **base),
    ]
    configs = [dataclasses.replace(c, save=str(tmp_path / f"{i}-distributed.pt")) for i, c in enumerate(configs)]
    assert_distributed_equals_emulated(configs, workers=2, timeout=300)
