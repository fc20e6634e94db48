"""Activation recomputation (``--recompute stage``): the same parameters, bitwise, as keeping every
activation, for every schedule, on the emulator and on the runtime; less held, as the memory model
says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipetrain import Pipeline
from pipetrain.execution import StageExecutor
from pipetrain.optim import SGD
from pipetrain.schedule import build, memory_by_rank


class Noise(nn.Module):
    """Random numbers drawn outside any ``nn.Dropout`` (replayed from the forward's random state)."""

    def forward(self, x):
        return x + 0.05 * torch.randn_like(x) if self.training else x


def stages(seed: int = 0) -> list[nn.Module]:
    """Four stages: dropout (a per-microbatch seed), unregistered noise, a LayerNorm, the head."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.2)),
        nn.Sequential(nn.Linear(12, 12), Noise(), nn.LayerNorm(12)),
        nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Dropout(0.1), nn.Linear(12, 12)),
        nn.Sequential(nn.Tanh(), nn.Linear(12, 3)),
    ]


def batches(steps: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)]


SCHEDULES = {
    "gpipe": dict(stages=4, microbatches=4),
    "1f1b": dict(stages=4, microbatches=4),
    "1f1b-replicated": dict(schedule="1f1b", stages=4, microbatches=4, replicas=[2, 1, 1, 1]),
    "interleaved": dict(stages=2, chunks=2, microbatches=4),
    "zb-h1": dict(stages=4, microbatches=4),
    "pipedream": dict(stages=4),
    "pipedream-vsync": dict(schedule="pipedream", stages=4, policy="vsync"),
    "pipedream-replicated": dict(schedule="pipedream", stages=4, replicas=[2, 1, 1, 1]),
    "2bw": dict(stages=4, microbatches=4),
    "pb": dict(stages=4),
    "pb-sc+lwp": dict(schedule="pb", stages=4, compensation="sc+lwp"),
}


def trained(name: str, recompute: str) -> list[torch.Tensor]:
    options = dict(SCHEDULES[name])
    schedule = options.pop("schedule", name)
    model = stages()
    pipe = Pipeline(model, schedule=schedule, optimizer="sgd:lr=0.1,momentum=0.9", executor="emulate",
                    recompute=recompute, **options)
    data = batches(6, 8)
    if schedule == "pb":  # batch size 1
        data = [(x[i:i + 1], y[i:i + 1]) for x, y in data[:3] for i in range(8)]
    pipe.train(data)
    return [p.detach().clone() for stage in model for p in stage.parameters()]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_recomputation_trains_bitwise_like_keeping_the_activations(name):
    kept, recomputed = trained(name, "none"), trained(name, "stage")
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))
    assert not all(torch.equal(a, b) for a, b in zip(kept, [p for s in stages() for p in s.parameters()]))


@pytest.mark.parametrize("name,stages", [("1f1b", "stage:0,2"), ("zb-h1", "stage:1,3"), ("pb", "stage:0,1"),
                                         ("interleaved", "stage:1,2")])
def test_recomputing_some_stages_trains_bitwise_like_keeping_the_activations(name, stages):
    """``stage:LIST``: only those stages recompute (interleaved: stage 1 is rank 1's first chunk,
    stage 2 rank 0's second, so each rank recomputes one of its two chunks)."""
    kept, recomputed = trained(name, "none"), trained(name, stages)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))
    from pipetrain.training import TrainConfig
    from pipetrain.training.setup import prepare

    options = {key: value for key, value in SCHEDULES[name].items() if key != "schedule"}
    run = prepare(TrainConfig(model="mlp:depth=3,width=8", data="synthetic:features=4,classes=2,samples=16",
                              batch_size=4 if name != "pb" else 1, steps=1, schedule=name, executor="emulate",
                              progress=False, recompute=stages, **options))
    assert sorted(run.recompute) == [int(s) for s in stages.split(":")[1].split(",")]
    executors = run.make_executors()
    assert {s: e.recompute for rank in executors for s, e in rank.items()} == {
        s: s in run.recompute for s in range(run.num_stages)}


def test_the_forms_of_recompute_and_their_errors(capsys, tmp_path):
    from pipetrain.cli import main
    from pipetrain.errors import ConfigError
    from pipetrain.schedule.recompute_stages import format_recompute, parse_recompute, recompute_stages
    from pipetrain.training.validate import RECOMPUTE

    from pipetrain.schedule.recompute_stages import RECOMPUTE as WORDS

    assert RECOMPUTE == WORDS
    assert parse_recompute("none") is False and parse_recompute("stage") is True
    assert parse_recompute("stage:2,0") == {0, 2}
    assert recompute_stages("stage", 3) == {0, 1, 2} and recompute_stages(None, 3) == frozenset()
    assert recompute_stages([1], 3) == {1} and recompute_stages(True, 2) == {0, 1}
    assert [format_recompute(s, 3) for s in ((), (0, 1, 2), (2, 0))] == ["none", "stage", "stage:0,2"]
    for bad in ("stages", "stage:", "stage:a", "stage:-1", "all"):
        with pytest.raises(ConfigError, match="write none, stage \\(every stage\\) or stage:LIST"):
            parse_recompute(bad)
    with pytest.raises(ConfigError, match="recompute='stage:1,4' names stage 4, but the schedule has 4 stages"):
        recompute_stages("stage:1,4", 4)
    import json

    from pipetrain.training import TrainConfig
    from pipetrain.training.validate import check_config

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"balance": [1, 1], "replicas": [1, 1], "stages": [{"recompute": "yes"}, {}]}))
    with pytest.raises(ConfigError, match="is not a plan written by `pipetrain plan --out` .*recompute must be true"):
        check_config(TrainConfig(plan=str(plan)))
    capsys.readouterr()
    assert main(["train", "--recompute", "stage:x", "--executor", "emulate"]) == 2  # before any work
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown --recompute 'stage:x'" in err
    assert main(["train", "--recompute", "stage:2", "--executor", "emulate", "--stages", "2", "--steps", "1",
                 "--model", "mlp:depth=1,width=4", "--data", "synthetic:features=4,classes=2,samples=8",
                 "--batch-size", "4", "--no-progress", "--quiet"]) == 2
    assert "names stage 2, but the schedule has 2 stages (0 to 1)" in capsys.readouterr().err


def test_a_stage_keeps_only_its_inputs_until_the_backward():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))
    kept = StageExecutor(1, module, SGD(lr=0.1))
    torch.manual_seed(0)
    again = StageExecutor(1, nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3)), SGD(lr=0.1),
                          recompute=True)
    x, grad = torch.randn(5, 6), torch.randn(5, 3)
    out = kept.forward(0, 0, x)
    out_again = again.forward(0, 0, x)
    assert torch.equal(out[0], out_again[0])
    assert again.in_flight[0].roots == () and kept.in_flight[0].roots[0].grad_fn is not None
    assert torch.equal(kept.backward(0, 0, (grad,))[0], again.backward(0, 0, (grad,))[0])
    for name, g in kept.grads.items():
        assert torch.equal(g, again.grads[name]), name


def test_recomputation_counts_batchnorm_statistics_once():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))

    results = []
    for recompute in ("none", "stage"):
        net = model()
        Pipeline(net, balance=[2, 2], schedule="1f1b", microbatches=2, optimizer="sgd:lr=0.1", executor="emulate",
                 recompute=recompute).train(batches(3, 8))
        results.append(net.state_dict())
    assert results[0]["1.num_batches_tracked"] == 6
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


def test_latest_keeps_the_forward_version_for_its_recomputation():
    """PB with ``latest``: the forward version of a sample is superseded before its backward; the
    update then must not overwrite it in place (the recomputation reads it)."""
    torch.manual_seed(0)
    executor = StageExecutor(0, nn.Linear(4, 4), SGD(lr=0.5), policy="latest", recompute=True)
    x = torch.randn(1, 4)
    executor.forward(0, 0, x)
    weight = executor.versions[0]["weight"].clone()
    executor.forward(1, 0, x)
    executor.backward(1, 0, (torch.ones(1, 4),))
    executor.step([0])  # version 0 released: nothing but sample 0's recomputation reads it
    assert torch.equal(executor.in_flight[0].leaf_set["weight"], weight)


def test_the_memory_model_counts_inputs_instead_of_activations():
    one_f_one_b = memory_by_rank(build("1f1b", 4, 8), recompute=True)
    assert [m.peak_inputs for m in one_f_one_b] == [{0: 4}, {1: 3}, {2: 2}, {3: 1}]
    assert [m.peak_activations for m in one_f_one_b] == [{s: 1} for s in range(4)]
    assert [m.peak_inputs for m in memory_by_rank(build("1f1b", 4, 8))] == [{}] * 4
    # ZB-H1: the graph recomputed for I stays until the deferred W
    assert [m.peak_activations for m in memory_by_rank(build("zb-h1", 4, 8), recompute=True)] == [
        {0: 1}, {1: 2}, {2: 3}, {3: 4}]
    # PB (latest): the forward's version lives until the backward recomputes on it: D_s + 1 versions
    pb = build("pb", 4, 40)
    assert [m.peak_versions for m in memory_by_rank(pb)] == [{s: 1} for s in range(4)]
    assert [m.peak_versions for m in memory_by_rank(pb, recompute=True)] == [{0: 7}, {1: 5}, {2: 3}, {3: 1}]
    # stashing schedules hold the forward's version anyway
    pipedream = build("pipedream", 4, 40)
    assert [m.peak_versions for m in memory_by_rank(pipedream, recompute=True)] == [
        m.peak_versions for m in memory_by_rank(pipedream)]


def test_the_memory_model_counts_recomputation_per_stage():
    one_f_one_b = build("1f1b", 4, 8)
    some = memory_by_rank(one_f_one_b, recompute={0, 2})
    assert some == memory_by_rank(one_f_one_b, recompute="stage:0,2")
    assert [m.peak_inputs for m in some] == [{0: 4}, {}, {2: 2}, {}]
    assert [m.peak_activations for m in some] == [{0: 1}, {1: 3}, {2: 1}, {3: 1}]
    # PB (latest): only a recomputing stage keeps its forward's version until the backward
    assert [m.peak_versions for m in memory_by_rank(build("pb", 4, 40), recompute={0})] == [
        {0: 7}, {1: 1}, {2: 1}, {3: 1}]
    # interleaved, 2 ranks x 2 chunks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; with
    # stages 1 and 2 recomputing each rank keeps one chunk's graphs and the other's inputs
    interleaved = build("interleaved", 2, 4, chunks=2)
    mixed, kept = memory_by_rank(interleaved, recompute={1, 2}), memory_by_rank(interleaved)
    assert [set(m.peak_inputs) for m in mixed] == [{2}, {1}]
    assert [m.peak_activations[s] for m, s in ((mixed[0], 0), (mixed[1], 3))] == [
        kept[0].peak_activations[0], kept[1].peak_activations[3]]
    # whole graphs held by the rank at once: rank 1's peak was stage 1's three microbatches, now
    # one graph; rank 0's is still stage 0's four, plus the one graph stage 2 recomputes meanwhile
    assert [m.rank_peak_activations for m in kept] == [5, 3]
    assert [m.rank_peak_activations for m in mixed] == [5, 1]


def test_runtime_with_recomputation_equals_the_emulator_without(tmp_path):
    from distributed_parity import run_all

    from pipetrain.runtime.launch import launch
    from pipetrain.training import TrainConfig
    from pipetrain.training.train import train

    base = dict(model="gpt:n_layer=2,n_head=2,n_embd=16,dropout=0.1", data="text:block_size=8,min_length=4",
                batch_size=8, steps=3, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, quiet=True,
                stages=2, timeout=60.0)
    configs = [TrainConfig(schedule=name, executor="distributed", recompute="stage",
                           save=str(tmp_path / f"{name}-distributed.pt"), **base) for name in ("1f1b", "pipedream")]
    result = launch(run_all, (configs,), nprocs=2, timeout=180, quiet=True)
    assert result.returncode == 0, result.message
    for config in configs:
        kept = dataclasses.replace(config, executor="emulate", recompute="none",
                                   save=config.save.replace("distributed", "emulated"))
        train(kept)
        a, b = torch.load(config.save), torch.load(kept.save)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (config.schedule, key)


#: every schedule the runtime test above leaves out, on 2 workers with a GPT that has dropout
RUNTIME = {"gpipe": {}, "zb-h1": {}, "interleaved": dict(chunks=2, microbatches=4), "2bw": dict(microbatches=4),
           "pb": dict(batch_size=1, steps=16), "pb-sc+lwp": dict(schedule="pb", batch_size=1, steps=16, compensation="sc+lwp"),
           "1f1b-stage:1": dict(schedule="1f1b", recompute="stage:1"),
           "interleaved-stage:0,3": dict(schedule="interleaved", chunks=2, microbatches=4, recompute="stage:0,3")}


def test_runtime_with_recomputation_equals_the_emulator_with_and_without_for_every_other_schedule(tmp_path):
    """gpipe, zb-h1 (a split backward: I recomputes, W reuses its graph), interleaved (two model
    chunks per worker), 2bw (two buffered versions) and pb with and without SC+LWP (``latest``
    and ``predict``: the forward's version superseded before its backward)."""
    from distributed_parity import run_all

    from pipetrain.runtime.launch import launch
    from pipetrain.training import TrainConfig
    from pipetrain.training.train import train

    base = dict(model="gpt:n_layer=2,n_head=2,n_embd=16,dropout=0.1", data="text:block_size=8,min_length=4",
                batch_size=8, steps=3, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, quiet=True,
                stages=2, timeout=60.0, eval_samples=8)
    configs = []
    for name, extra in RUNTIME.items():
        options = {"schedule": name, "recompute": "stage", **base, **extra}
        configs.append(TrainConfig(executor="distributed", save=str(tmp_path / f"{name}-stage-distributed.pt"),
                                   **options))
    result = launch(run_all, (configs,), nprocs=2, timeout=240, quiet=True)
    assert result.returncode == 0, result.message
    for name, config in zip(RUNTIME, configs):
        distributed = torch.load(config.save)
        for recompute in (config.recompute, "none"):
            emulated = dataclasses.replace(config, executor="emulate", recompute=recompute,
                                           save=str(tmp_path / f"{name}-{recompute}-emulated.pt"))
            train(emulated)
            reference = torch.load(emulated.save)
            assert reference.keys() == distributed.keys()
            for key in reference:
                assert torch.equal(distributed[key], reference[key]), (name, recompute, key)


def test_a_split_backward_recomputes_each_forward_once():
    """ZB-H1 with recomputation: each microbatch's forward runs twice on a stage (F, and once more
    for I); W differentiates the graph I built, it does not recompute again."""
    calls = []

    class Counted(nn.Module):
        def __init__(self, stage: int, inner: nn.Module) -> None:
            super().__init__()
            self.stage, self.inner = stage, inner

        def forward(self, x):
            calls.append(self.stage)
            return self.inner(x)

    for recompute, per_forward in (("none", 1), ("stage", 2)):
        calls.clear()
        model = [Counted(s, m) for s, m in enumerate(stages())]
        Pipeline(model, schedule="zb-h1", microbatches=4, optimizer="sgd:lr=0.1", executor="emulate",
                 recompute=recompute).train(batches(2, 8))
        assert [calls.count(s) for s in range(4)] == [2 * 4 * per_forward] * 4, recompute


def test_a_recomputing_run_resumes_from_a_checkpoint_to_the_uninterrupted_parameters(tmp_path):
    """Microbatches in flight at the checkpoint are replayed and recomputed; PB's forward versions,
    kept for the checkpoint, stay unchanged until their backward. A checkpoint of a recomputing run
    also resumes without recomputation (PipeDream here)."""
    from distributed_parity import run_all

    from pipetrain.runtime.launch import launch
    from pipetrain.training import TrainConfig
    from pipetrain.training.train import train

    base = dict(model="mlp:depth=6,width=16", data="synthetic:features=8,classes=3,samples=96", executor="distributed",
                progress=False, quiet=True, timeout=60, recompute="stage", stages=3)
    cases = {"pb": dict(schedule="pb", batch_size=1, steps=20, checkpoint_every=6),
             "pipedream": dict(schedule="pipedream", batch_size=12, steps=9, checkpoint_every=4)}
    configs, resumed = [], []
    for name, options in cases.items():
        config = TrainConfig(**base, **options, checkpoint_dir=str(tmp_path / name), save=str(tmp_path / f"{name}.pt"))
        period = options["checkpoint_every"]  # the newest but one is kept: microbatches in flight there
        newest_but_one = [*range(period, config.steps, period), config.steps][-2]
        configs.append(config)
        resumed.append(dataclasses.replace(config, checkpoint_dir=str(tmp_path / f"{name}-resumed"),
                                           recompute="stage" if name == "pb" else "none",  # resumes either way
                                           resume=str(tmp_path / name / f"step-{newest_but_one:06d}"),
                                           save=str(tmp_path / f"{name}-resumed.pt")))
    result = launch(run_all, (configs + resumed,), nprocs=3, timeout=300, quiet=True)
    assert result.returncode == 0, result.message
    for config, again in zip(configs, resumed):
        kept = dataclasses.replace(config, executor="emulate", recompute="none", checkpoint_dir=None,
                                   checkpoint_every=0, save=str(tmp_path / f"{config.schedule}-emulated.pt"))
        train(kept)
        reference = torch.load(kept.save)
        for path in (config.save, again.save):
            state = torch.load(path)
            assert all(torch.equal(state[k], reference[k]) for k in reference), (config.schedule, path)


# -- the recomputation on its own ------------------------------------------------------------------


def test_a_forward_run_again_draws_the_same_random_numbers_and_leaves_the_callers_alone():
    from pipetrain.execution.recompute import Recomputation

    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    for seed in (None, lambda microbatch: 1000 + microbatch):  # from the random state, or seeded
        recomputation = Recomputation(module, torch.device("cpu"), seed, enabled=True)
        torch.manual_seed(5)
        state = recomputation.begin(3)
        assert (state is None) == (seed is not None)
        first = module(x)
        torch.manual_seed(6)
        before = torch.get_rng_state()
        again = recomputation.again(3, state, lambda: module(x))
        assert torch.equal(first, again) and again.requires_grad
        assert torch.equal(torch.get_rng_state(), before)
    assert Recomputation(module, torch.device("cpu"), None, enabled=False).begin(0) is None  # nothing to keep


def test_a_forward_run_again_writes_into_copies_of_the_buffers_even_when_it_raises():
    from pipetrain.execution.recompute import Recomputation

    norm = nn.BatchNorm1d(3)
    recomputation = Recomputation(norm, torch.device("cpu"), None, enabled=True)
    mean, count = norm.running_mean, norm.num_batches_tracked.clone()
    with torch.no_grad():
        recomputation.again(0, None, lambda: norm(torch.randn(4, 3) + 10))
    assert norm.running_mean is mean and torch.equal(mean, torch.zeros(3))
    assert torch.equal(norm.num_batches_tracked, count)

    def fails():
        norm(torch.randn(4, 3))
        raise RuntimeError("the user's forward")

    with pytest.raises(RuntimeError, match="the user's forward"):
        recomputation.again(0, None, fails)
    assert norm.running_mean is mean and torch.equal(mean, torch.zeros(3))


def test_only_a_dropout_that_drops_makes_a_stage_stochastic():
    from pipetrain.execution.recompute import is_stochastic

    assert is_stochastic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert not is_stochastic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))


def test_each_stage_and_microbatch_of_a_run_has_a_seed_of_its_own():
    from pipetrain.execution.recompute import microbatch_seed

    seeds = {microbatch_seed(seed, stage, microbatch)
             for seed in range(3) for stage in range(4) for microbatch in range(50)}
    assert len(seeds) == 3 * 4 * 50
    assert microbatch_seed(1, 2, 3) == (1 * 1_000_003 + 2) * 1_000_003 + 3
