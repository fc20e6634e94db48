"""Pipelined Backpropagation on the emulator (docs/design.md 3.4, 3.5)."""

import copy

import pytest
import torch
import torch.nn as nn

from pipetrain import Pipeline
from pipetrain.execution import StageExecutor
from pipetrain.optim import SGD
from pipetrain.schedule import pb_delays


def mlp_stages(count=4, width=5, seed=0):
    torch.manual_seed(seed)
    stages = [nn.Sequential(nn.Linear(4 if i == 0 else width, width), nn.Tanh()) for i in range(count - 1)]
    return [s.double() for s in stages] + [nn.Linear(width, 3).double()]


def samples(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 4, generator=generator, dtype=torch.float64),
             torch.randint(0, 3, (1,), generator=generator)) for _ in range(count)]


def optimizer(stage, delay, compensation=""):
    return SGD(lr=0.05, momentum=0.9, sc_delay=delay if "sc" in compensation else 0.0,
               lwp_horizon=delay if "lwp" in compensation else 0.0)


def sample_sequential(stages, data, delays, make_optimizer, policy="latest"):
    """The sample-sequential form: sample n's forward at stage s reads version n - D_s (a ring
    buffer of the last D_s + 1 versions), its backward the current weights, then every stage
    updates. Same stage machinery, a different order of work than the pipeline's ticks."""
    count = len(stages)
    executors = [
        StageExecutor(s, stages[s], make_optimizer(s, delays[s]),
                      loss_fn=nn.functional.cross_entropy if s == count - 1 else None, policy=policy)
        for s in range(count)
    ]
    # weights as each version's forward reads them: predicted (LWP) when the version was made
    ring = [{0: e.optimizer.predict(e.versions[0], 0) if policy == "predict" else e.versions[0]} for e in executors]
    for n, (x, y) in enumerate(data):
        value = x
        for s, executor in enumerate(executors):
            version = max(0, n - delays[s])
            out = executor.forward(n, version, value, target=y if s == count - 1 else None, samples=1,
                                   params=ring[s][version])
            value = out
        grads = None
        for s in reversed(range(count)):
            executor = executors[s]
            grads = executor.backward(n, executor.versions.current, grads)
        for s, executor in enumerate(executors):
            keep = n + 1 - delays[s]  # versions older than this are never read again
            made = executor.step([v for v in executor.versions.held() if v < keep])
            latest = executor.versions[made]
            ring[s][made] = executor.optimizer.predict(latest, executor.samples_seen) if policy == "predict" else latest
            for old in [v for v in ring[s] if v < keep]:
                del ring[s][old]
    for executor in executors:
        executor.write_back()
    return stages


def pipelined(stages, data, compensation=""):
    pipe = Pipeline(stages, executor="emulate", schedule="pb", optimizer=lambda s, d: optimizer(s, d, compensation),
                    compensation="lwp" if "lwp" in compensation else "none")
    pipe.train(data)
    return stages


def test_tick_and_sample_sequential_agree_bitwise():
    data = samples(40)
    a, b = mlp_stages(), mlp_stages()
    pipelined(a, data)
    sample_sequential(b, data, pb_delays(4), optimizer)
    for sa, sb in zip(a, b):
        for p, q in zip(sa.parameters(), sb.parameters()):
            assert torch.equal(p, q)


def test_tick_and_sample_sequential_agree_with_compensation():
    data = samples(30)
    for compensation in ("sc", "lwp", "sc+lwp"):
        a, b = mlp_stages(), mlp_stages()
        pipelined(a, data, compensation)
        policy = "predict" if "lwp" in compensation else "latest"
        sample_sequential(b, data, pb_delays(4), lambda s, d: optimizer(s, d, compensation), policy=policy)
        for sa, sb in zip(a, b):
            for p, q in zip(sa.parameters(), sb.parameters()):
                assert torch.equal(p, q), compensation


def test_zero_delays_equal_batch_size_one_momentum_sgd():
    data = samples(25)
    stages = mlp_stages()
    sample_sequential(stages, data, [0, 0, 0, 0], optimizer)
    reference = nn.Sequential(*copy.deepcopy(mlp_stages()))
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, foreach=False)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for p, q in zip(nn.Sequential(*stages).parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_lwp_with_zero_horizon_is_plain_pb():
    data = samples(20)
    a, b = mlp_stages(), mlp_stages()
    Pipeline(a, executor="emulate", schedule="pb", compensation="lwp",
             optimizer=lambda s, d: SGD(lr=0.05, momentum=0.9, lwp_horizon=0.0)).train(data)
    pipelined(b, data)
    for sa, sb in zip(a, b):
        for p, q in zip(sa.parameters(), sb.parameters()):
            assert torch.equal(p, q)


def test_latest_backward_uses_current_weights_for_the_error_and_forward_activations_for_the_gradient():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    executor = StageExecutor(1, layer, SGD(lr=0.5), policy="latest")
    x = torch.randn(1, 3, dtype=torch.float64)
    old_weight = layer.weight.detach().clone()
    executor.forward(0, 0, x, samples=1)
    executor.forward(1, 0, x, samples=1)  # a second microbatch in flight, as in a pipeline
    grad_out = torch.randn(1, 2, dtype=torch.float64)
    executor.backward(1, 0, (grad_out,))
    executor.step()  # version 1: different weights
    new_weight = executor.versions[1]["weight"]
    assert not torch.equal(new_weight, old_weight)
    (grad_x,) = executor.backward(0, 1, (grad_out,))
    assert torch.equal(grad_x, grad_out @ new_weight)  # error through the current weights
    assert torch.equal(executor.grads["weight"], grad_out.t() @ x)  # gradient from forward activations


def test_delays_are_two_s_minus_one_minus_s():
    pipe = Pipeline(mlp_stages(5), executor="emulate", schedule="pb", optimizer=lambda s, d: SGD(lr=0.01))
    pipe.train(samples(12))
    from pipetrain.schedule import staleness

    assert staleness(pipe.last_schedule) == [8, 6, 4, 2, 0]


def test_emulator_agrees_with_the_pb_reference_implementation():
    """The schedule-driven emulator and pipetrain.pb's own reference (written independently)
    compute the same PB, bit for bit in float64, with and without compensation."""
    from pipetrain.pb.reference import pb_sequential

    data = samples(30)
    for compensation in ("", "sc", "lwp", "sc+lwp"):
        a, b = mlp_stages(), mlp_stages()
        pipelined(a, data, compensation)
        optimizers = [optimizer(s, d, compensation) for s, d in enumerate(pb_delays(4))]
        result = pb_sequential(b, optimizers, data)
        for s, stage in enumerate(a):
            for name, p in stage.named_parameters():
                assert torch.equal(p.detach(), result.params[s][name]), f"{compensation} stage {s} {name}"


@pytest.mark.parametrize("compensation, momenta, contrast", [
    ("sc+lwp+dlr2", [0.9, 0.9, 0.9, 0.9], "sc+lwp"),  # DLR: the rates only
    ("sc+lwp+dts2", [1 - (1 - 0.9) / 3, 1 - (1 - 0.9) / 2, 0.9, 0.9], "sc+lwp+dlr2"),  # DTS: DLR's rates, longer memory
    ("sc+lwp+dtt2", [1 - (1 - 0.9) / 9, 1 - (1 - 0.9) / 4, 0.9, 0.9], "sc+lwp+dts2"),  # DTT: memory k**2 longer
])
def test_delay_scaling_from_a_spec_string_on_the_emulator_equals_the_reference_and_the_study_engine(
        compensation, momenta, contrast):
    """A delay-scaled compensation built from the spec string per stage (as ``pipetrain train
    --compensation`` does) trains what the PB reference and the study's batched engine train with
    the same optimizers: bitwise against the reference, to rounding against the engine."""
    from pipetrain.optim import build_stage_optimizers
    from pipetrain.pb.engine import BatchedPB
    from pipetrain.pb.reference import pb_sequential

    spec, data = "sgd:lr=0.05,momentum=0.9", samples(30)
    a, b, c = mlp_stages(), mlp_stages(), mlp_stages()
    pipe = Pipeline(a, executor="emulate", schedule="pb", optimizer=spec, compensation=compensation)
    pipe.train(data)
    optimizers = build_stage_optimizers(spec, pb_delays(4), compensation=compensation)
    assert [o.lr for o in optimizers] == [0.05 * (2 / 6) ** 2, 0.05 * 0.25, 0.05, 0.05]
    assert [o.momentum for o in optimizers] == momenta
    result = pb_sequential(b, optimizers, data)
    engine = BatchedPB([c], [build_stage_optimizers(spec, pb_delays(4), compensation=compensation)],
                       sample_shape=(4,), dtype=torch.float64)
    x = torch.cat([x for x, _ in data])
    y = torch.cat([y for _, y in data])
    engine.train(x, y, torch.arange(len(data)).view(-1, 1))
    engine.write_back()
    for s, (stage, fast) in enumerate(zip(a, c)):
        for (name, p), q in zip(stage.named_parameters(), fast.parameters()):
            assert torch.equal(p.detach(), result.params[s][name]), f"stage {s} {name}"
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-10, atol=1e-12)
    # and the scaling did something: the compensation without it ends elsewhere
    d = mlp_stages()
    Pipeline(d, executor="emulate", schedule="pb", optimizer=spec, compensation=contrast).train(data)
    assert not torch.equal(d[0][0].weight, a[0][0].weight)


def test_rate_following_dts_with_a_decaying_schedule_on_the_emulator_equals_the_reference_and_the_study_engine():
    """dtsf's stages change rate and momentum while the lr schedule decays: the emulator (built
    from the spec strings, as ``pipetrain train --compensation sc+lwp+dtsf2 --lr-schedule ...``),
    the PB reference and the batched study engine train the same thing."""
    from pipetrain.optim import build_stage_optimizers
    from pipetrain.optim.sgd import RateFollowingSGD
    from pipetrain.pb.engine import BatchedPB
    from pipetrain.pb.reference import pb_sequential

    spec, data, schedule = "sgd:lr=0.05,momentum=0.9", samples(30), "end:total=30,fraction=0.6"
    a, b, c, d = mlp_stages(), mlp_stages(), mlp_stages(), mlp_stages()
    Pipeline(a, executor="emulate", schedule="pb", optimizer=spec, compensation="sc+lwp+dtsf2",
             lr_scheduler=schedule).train(data)
    optimizers = build_stage_optimizers(spec, pb_delays(4), compensation="sc+lwp+dtsf2", lr_schedule=schedule)
    assert [type(o) for o in optimizers[:2]] == [RateFollowingSGD] * 2
    result = pb_sequential(b, optimizers, data)
    assert [o.momentum for o in optimizers[:2]] == [0.9, 0.9]  # at the end of the decay: k = 1
    engine = BatchedPB([c], [build_stage_optimizers(spec, pb_delays(4), compensation="sc+lwp+dtsf2",
                                                    lr_schedule=schedule)], sample_shape=(4,), dtype=torch.float64)
    engine.train(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), torch.arange(len(data)).view(-1, 1))
    engine.write_back()
    for s, (stage, fast) in enumerate(zip(a, c)):
        for (name, p), q in zip(stage.named_parameters(), fast.parameters()):
            assert torch.equal(p.detach(), result.params[s][name]), f"stage {s} {name}"
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-10, atol=1e-12)
    # and following the rate did something: DTS (k fixed) ends elsewhere
    Pipeline(d, executor="emulate", schedule="pb", optimizer=spec, compensation="sc+lwp+dts2",
             lr_scheduler=schedule).train(data)
    assert not torch.equal(d[0][0].weight, a[0][0].weight)
