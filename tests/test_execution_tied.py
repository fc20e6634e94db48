"""Tied parameters trained across stages: equal to plain tied training, refused where they cannot be.

An LM whose output head reuses the input embedding's weight, cut so that the two uses lie in the
first and the last stage, given as a list of stage modules and as a traced module. With one
microbatch per step the pipeline adds the two stages' gradients of the shared weight once, as
autograd does in one process: bitwise equal. With several microbatches plain training adds the
two uses per microbatch and accumulates, the pipeline accumulates per stage and then adds the two
sums: the same terms in another order, equal to float64 rounding.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from distributed_parity import assert_distributed_equals_emulated
from torch import nn

from pipetrain import Pipeline
from pipetrain.errors import ConfigError
from pipetrain.models import build_model
from pipetrain.stages import split_model
from pipetrain.training import TrainConfig
from pipetrain.training.train import train

OPTIMIZER = "sgd:lr=0.1,momentum=0.9"


def tied_gpt(seed: int = 0) -> nn.Module:
    spec = "gpt:n_layer=3,n_head=2,n_embd=16,tie=true"
    return build_model(spec, input_shape=(12,), num_classes=11, seed=seed).double()


def batches(steps: int = 3, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (size, 12), generator=g), torch.randint(0, 11, (size, 12), generator=g))
            for _ in range(steps)]


def plain_tied_training(model: nn.Module, data) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()


CASES = [("1f1b", 1, {}), ("1f1b", 4, {}), ("gpipe", 4, {}), ("zb-h1", 2, {}),
         ("interleaved", 4, {"chunks": 2}), ("1f1b", 4, {"replicas": [2, 1]})]


@pytest.mark.parametrize("form", ["list", "traced"])
@pytest.mark.parametrize("schedule, microbatches, options", CASES, ids=lambda c: str(c))
def test_tied_lm_head_trains_as_plain_tied_training(form, schedule, microbatches, options):
    model = tied_gpt()
    reference = copy.deepcopy(model)
    pieces = 4 if schedule == "interleaved" else 2 if "replicas" in options else 3
    staged = split_model(model, stages=pieces)
    assert [t.stages for t in staged.tied] == [(0, pieces - 1)]
    given = list(staged.stages) if form == "list" else model
    pipe = Pipeline(given, executor="emulate", stages=pieces, schedule=schedule, microbatches=microbatches,
                    optimizer=OPTIMIZER, **options)
    data = batches()
    pipe.train(data)
    plain_tied_training(reference, data)
    trained = dict(model.named_parameters())
    assert model.head.weight is model.wte.weight  # still one parameter
    for name, expected in reference.named_parameters():
        if microbatches == 1:
            assert torch.equal(trained[name], expected), name
        else:
            torch.testing.assert_close(trained[name], expected, rtol=1e-12, atol=1e-14, msg=name)
    moved = (trained["wte.weight"] - tied_gpt().wte.weight).abs().max()
    assert moved > 1e-3  # the shared weight trained


@pytest.mark.parametrize("schedule, ranks, microbatches", [("zb-v", 2, 3), ("v-half", 2, 4), ("zb-h2", 4, 4)])
def test_tied_lm_head_on_zero_bubble_schedules(schedule, ranks, microbatches):
    """A V puts the first and the last stage, the tied embedding and head, on rank 0: their
    gradients are summed there as between ranks."""
    model = tied_gpt()
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, executor="emulate", stages=ranks, schedule=schedule, microbatches=microbatches,
                    optimizer=OPTIMIZER)
    assert [t.stages for t in pipe.staged.tied] == [(0, 3)]
    data = batches()
    pipe.train(data)
    plain_tied_training(reference, data)
    trained = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(trained[name], expected, rtol=1e-12, atol=1e-14, msg=name)
    assert (trained["wte.weight"] - tied_gpt().wte.weight).abs().max() > 1e-3


@pytest.mark.parametrize("schedule, options", [("pipedream", {}), ("2bw", {"microbatches": 3}),
                                               ("pb", {})])
def test_versioned_schedules_refuse_a_tied_parameter(schedule, options):
    with pytest.raises(ConfigError) as info:
        Pipeline(tied_gpt(), executor="emulate", stages=2, schedule=schedule, **options).train(batches())
    message = str(info.value)
    for words in ("'wte.weight' (stage 0 as wte.weight, stage 1 as head.weight)", "stages 0 and 1", schedule,
                  "synchronous schedule", "model.head.weight = nn.Parameter(model.wte.weight"):
        assert words in message, words


def test_the_cli_configuration_refuses_pipedream_before_training(tmp_path):
    config = TrainConfig(model="gpt:n_layer=2,n_head=2,n_embd=16,tie=true", data="text:block_size=8", steps=2,
                         batch_size=4, schedule="pipedream", stages=2, executor="emulate", progress=False)
    with pytest.raises(ConfigError, match="'wte.weight' .* is shared by stages 0 and 1"):
        train(config)


FACTORY = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Embed(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.wte(ids)


def tied_lm(num_classes, width=16):
    """A list of units: the last one's Linear reuses the embedding's weight."""
    embed = Embed(num_classes, width)
    head = nn.Linear(width, num_classes, bias=False)
    head.weight = embed.wte.weight
    return [embed, nn.Sequential(nn.Linear(width, width), nn.Tanh()), nn.Sequential(nn.LayerNorm(width), head)]


def tokens(split="train"):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randint(0, 13, (64, 6), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))
'''


def test_runtime_equals_emulator_and_saves_one_tensor(tmp_path, monkeypatch):
    (tmp_path / "tiedlm.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    base = dict(data="tiedlm:tokens", batch_size=8, steps=4, optimizer=OPTIMIZER, progress=False, timeout=60.0,
                executor="distributed")
    configs = [
        TrainConfig(model="tiedlm:tied_lm", schedule="1f1b", stages=2, microbatches=4, **base),
        TrainConfig(model="gpt:n_layer=2,n_head=2,n_embd=16,tie=true", schedule="interleaved", chunks=2, stages=2,
                    microbatches=2, **base),
    ]
    configs = [dataclasses.replace(c, save=str(tmp_path / f"{i}-distributed.pt")) for i, c in enumerate(configs)]
    assert_distributed_equals_emulated(configs, 2, timeout=240)
    saved = torch.load(tmp_path / "0-distributed.pt")
    assert torch.equal(saved["0.wte.weight"], saved["2.1.weight"])
    fresh = build_model("tiedlm:tied_lm", input_shape=(6,), num_classes=13)
    fresh.load_state_dict(saved, strict=True)
    assert fresh[2][1].weight is fresh[0].wte.weight
    saved = torch.load(tmp_path / "1-distributed.pt")
    assert torch.equal(saved["wte.weight"], saved["head.weight"])


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_tie_inside_one_stage_reads_one_version(schedule):
    """Both uses of the shared weight in one stage read the version the action names (a regression:
    the head used to read the module's own, never updated, parameter)."""
    model = tied_gpt()
    reference = copy.deepcopy(model)
    data = batches(size=4)
    Pipeline(model, executor="emulate", stages=1, schedule=schedule, microbatches=1, optimizer=OPTIMIZER).train(data)
    plain_tied_training(reference, data)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
