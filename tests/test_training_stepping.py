"""Runs fed one batch at a time (Pipeline.start/step/finish) equal whole runs (Pipeline.fit), for
every schedule, on the emulator; FedBatches hands the executors exactly what the loop gave."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipetrain import Pipeline, PipetrainError
from pipetrain.execution import UnitLayout
from pipetrain.training.stepping import FedBatches

CASES = [
    ("gpipe", dict(microbatches=2), 8),
    ("1f1b", dict(microbatches=4, stages=3), 8),
    ("zb-h1", dict(microbatches=2), 8),
    ("interleaved", dict(microbatches=2, chunks=2), 8),
    ("pipedream", dict(stages=3), 4),
    ("pipedream", dict(replicas=[2, 1], stages=2), 4),
    ("pipedream", dict(microbatches=2, policy="vsync"), 4),
    ("2bw", dict(microbatches=2), 8),
    ("pb", dict(stages=4), 1),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())], nn.Linear(6, 3))


def _data(n=48):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("name, options, batch", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_feeding_batch_by_batch_equals_fit(name, options, batch):
    options = dict(options)
    stages = options.pop("stages", 2)
    x, y = _data()
    steps = 12

    def pipeline(model):
        return Pipeline(model, stages=stages, schedule=name, optimizer="sgd:lr=0.05,momentum=0.9",
                        executor="emulate", **options)

    fitted_model = _model()
    fitted = pipeline(fitted_model).fit(TensorDataset(x, y), batch_size=batch, steps=steps, shuffle=False,
                                        progress=False)
    stepped_model = _model()
    pipe = pipeline(stepped_model)
    pipe.start(steps=steps, batch_size=batch)
    finished = []
    for update in range(steps):
        start = update * batch % len(x)
        finished += pipe.step(x[start:start + batch], y[start:start + batch])
    result = pipe.finish()
    assert [u for u, _ in finished] == list(range(steps))
    assert [loss for _, loss in finished] == result.update_losses == fitted.update_losses
    for p, q in zip(stepped_model.parameters(), fitted_model.parameters()):
        assert torch.equal(p, q)


def test_fed_batches_are_cut_into_units_and_dropped_once_read():
    data = FedBatches(UnitLayout(4, 2), torch.float64, reads_per_unit=2)
    x = torch.arange(8.0).view(4, 2)
    data.feed(0, x.float(), torch.arange(4))
    first, _ = data.unit(0)
    assert first.dtype == torch.float64 and first.tolist() == [[0, 1], [2, 3]]
    data.unit(0), data.unit(1), data.unit(1)
    with pytest.raises(PipetrainError, match="not handed over"):
        data.unit(0)
    with pytest.raises(PipetrainError, match="batch_size=4"):
        data.feed(1, x[:3], torch.arange(3))
