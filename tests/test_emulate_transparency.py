"""Transparency: every synchronous schedule trains to the parameters of plain training.

Comparisons are bitwise when each update has one microbatch (m = 1): the pipeline then runs the
same operations in the same order as the plain model. With m > 1 the pipeline sums m partial
gradients while plain training computes the whole batch in one matrix product, so the two round
differently: they agree to float64 rounding (rtol 1e-12), and float32 runs agree to ~1e-6.
"""


import pytest
import torch
import torch.nn as nn

from pipetrain import Pipeline

UNITS = 8


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(6 if i == 0 else 10, 10), nn.Tanh()) for i in range(UNITS - 1)]
    return nn.Sequential(*blocks, nn.Linear(10, 3)).to(dtype)


def make_batches(steps=3, size=8, dtype=torch.float64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 6, generator=generator, dtype=dtype), torch.randint(0, 3, (size,), generator=generator))
        for _ in range(steps)
    ]


def plain_training(model, batches, optimizer):
    opt = optimizer(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


OPTIMIZERS = {
    "sgd": ("sgd:lr=0.1,momentum=0.9", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
    "adam": ("adam:lr=0.01", lambda p: torch.optim.Adam(p, lr=0.01, foreach=False)),
}


def balance_for(pieces):
    base, extra = divmod(UNITS, pieces)
    return [base + (1 if i < extra else 0) for i in range(pieces)]


def assert_same(a, b, bitwise):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if bitwise:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_synchronous_schedules_equal_plain_training(name, stages, optimizer):
    spec, reference = OPTIMIZERS[optimizer]
    chunks = 2 if name == "interleaved" else 1
    for m in range(1, 9):
        if name == "interleaved" and m % stages:
            continue
        batches = make_batches()
        expected = plain_training(make_model(), batches, reference)
        model = make_model()
        pipe = Pipeline(model, executor="emulate", balance=balance_for(stages * chunks), schedule=name, microbatches=m,
                        optimizer=spec, chunks=chunks)
        pipe.train(batches)
        assert_same(model, expected, bitwise=(m == 1))


@pytest.mark.parametrize("name", ["bfs", "interleaved-zb", "dualpipev"])
@pytest.mark.parametrize("stages", [2, 3])
def test_schedules_from_torch_equal_plain_training(name, stages):
    """Two model chunks per rank (looped, or dualpipev's V with its paired F and B)."""
    spec, reference = OPTIMIZERS["adam"]
    for m in (1, 2 * stages, 2 * stages + 2):
        if name == "dualpipev" and m < 2 * stages:
            continue
        batches = make_batches()
        expected = plain_training(make_model(), batches, reference)
        model = make_model()
        pipe = Pipeline(model, executor="emulate", balance=balance_for(2 * stages), schedule=name, microbatches=m,
                        optimizer=spec, chunks=1 if name == "dualpipev" else 2)
        pipe.train(batches)
        assert_same(model, expected, bitwise=(m == 1))


def test_float32_agreement_and_save_keys():
    batches = make_batches(dtype=torch.float32)
    expected = plain_training(make_model(dtype=torch.float32), batches, OPTIMIZERS["sgd"][1])
    model = make_model(dtype=torch.float32)
    pipe = Pipeline(model, executor="emulate", balance=[3, 3, 2], schedule="1f1b", microbatches=4, optimizer=OPTIMIZERS["sgd"][0])
    pipe.train(batches)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6)
    state = pipe.state_dict()
    assert set(state) == set(expected.state_dict())


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_replicated_stage_equals_plain_training(name):
    batches = make_batches(size=8)
    expected = plain_training(make_model(), batches, OPTIMIZERS["sgd"][1])
    model = make_model()
    pipe = Pipeline(model, executor="emulate", balance=[4, 4], schedule=name, microbatches=4, replicas=[2, 1],
                    optimizer=OPTIMIZERS["sgd"][0])
    pipe.train(batches)
    assert_same(model, expected, bitwise=False)


def test_dropout_is_deterministic_per_microbatch():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 10), nn.Dropout(0.5), nn.Linear(10, 3)).double()

    batches = make_batches()
    first, second = build(), build()
    Pipeline(first, executor="emulate", balance=[2, 1], schedule="1f1b", microbatches=2, optimizer="sgd:lr=0.1").train(batches)
    Pipeline(second, executor="emulate", balance=[2, 1], schedule="gpipe", microbatches=2, optimizer="sgd:lr=0.1").train(batches)
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q)


def plain_accumulated_training(model, batches, optimizer, microbatches):
    """Plain PyTorch at one thread, accumulating as the pipeline does: each microbatch's mean loss
    times its share of the batch, backward, in microbatch order; then the update."""
    opt = optimizer(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        for xs, ys in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
            (nn.functional.cross_entropy(model(xs), ys) * (len(ys) / len(y))).backward()
        opt.step()
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name, ranks, m", [
    ("zb-h2", 1, 2), ("zb-h2", 3, 5), ("zb-h2", 4, 8), ("zb-v", 1, 1), ("zb-v", 2, 3), ("zb-v", 3, 8),
    ("v-half", 2, 4), ("v-half", 3, 5), ("v-min", 3, 6), ("v-min", 4, 8), ("zb-auto", 3, 8), ("zb-auto", 2, 2),
])
def test_zero_bubble_schedules_equal_plain_accumulation_bitwise(name, ranks, m, optimizer):
    """The zero-bubble and V schedules (docs/design.md 3.1) add each stage's microbatch gradients in
    microbatch order, as a plain loop that accumulates them does: bitwise equal at one thread."""
    from pipetrain.schedule.presets import chunks_per_rank

    spec, reference = OPTIMIZERS[optimizer]
    batches = make_batches()
    expected = plain_accumulated_training(make_model(), batches, reference, m)
    model = make_model()
    pieces = ranks * chunks_per_rank(name, ranks, m)
    pipe = Pipeline(model, executor="emulate", balance=balance_for(pieces), stages=ranks, schedule=name,
                    microbatches=m, optimizer=spec)
    pipe.train(batches)
    assert len(pipe.staged.stages) == pieces
    assert_same(model, expected, bitwise=True)


@pytest.mark.parametrize("recompute", ["stage", "stage:0,3"])
def test_a_v_rank_recomputing_its_chunks_trains_alike(recompute):
    """zb-v with activation recomputation (both chunks of a rank, or stages 0 and 3: rank 0's two)
    ends with the parameters it has without."""
    trained = []
    for option in ("none", recompute):
        model = make_model()
        pipe = Pipeline(model, executor="emulate", balance=balance_for(4), stages=2, schedule="zb-v", microbatches=3,
                        optimizer=OPTIMIZERS["sgd"][0], recompute=option)
        pipe.train(make_batches())
        trained.append(model)
    assert_same(trained[0], trained[1], bitwise=True)
