"""The Python API as a user's script uses it: spawned workers, torchrun, the emulator, fit and a
loop of step() calls (tests/api_script.py is the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torchrun_agents
import torch
from torch import nn

import api_script
from pipetrain import Pipeline, PipetrainError
from pipetrain.errors import ConfigError
from pipetrain.training.callbacks import Callback

SCRIPT = os.path.join(os.path.dirname(__file__), "api_script.py")
RUNS = ("1f1b-fit", "pipedream-fit", "pipedream-step", "pipedream-loader")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulated")
    api_script.main([str(out), "--executor", "emulate"])
    return out


def _assert_same(first, second, name):
    a, b = torch.load(os.path.join(first, f"{name}.pt")), torch.load(os.path.join(second, f"{name}.pt"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (name, key)
    with open(os.path.join(first, f"{name}.json")) as f, open(os.path.join(second, f"{name}.json")) as g:
        assert json.load(f)["losses"] == json.load(g)["losses"]


def test_python_train_py_spawns_its_workers_and_equals_the_emulator(tmp_path, emulated):
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in RUNS:
        _assert_same(tmp_path, emulated, name)
        with open(tmp_path / f"{name}.json") as f:
            assert json.load(f)["workers"] == 2
    with open(tmp_path / "pipedream-fit.json") as f:
        assert json.load(f)["checkpoints"] == [[3, "step-000003"], [6, "step-000006"]]  # every 3 updates, and the last
    with open(emulated / "pipedream-step-eval-0.json") as g:
        expected = json.load(g)
    assert expected is not None and set(expected) >= {"loss", "accuracy"}
    for rank in (0, 1):  # evaluation between two steps, through the pipeline: the metrics on every rank
        with open(tmp_path / f"pipedream-step-eval-{rank}.json") as f:
            assert json.load(f) == expected, rank


def test_fit_on_a_dataloader_reads_its_batches_like_fit_on_its_dataset(emulated):
    # DataLoader(data, batch_size=8, num_workers=1) yields fit(data, shuffle=False)'s batches
    a, b = torch.load(emulated / "pipedream-loader.pt"), torch.load(emulated / "pipedream-fit.pt")
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_the_same_script_under_two_torchrun_agents_equals_the_emulator(tmp_path, emulated):
    codes, text = torchrun_agents.run([SCRIPT, str(tmp_path), "--runs", "1f1b:fit,pipedream:step"],
                                      rdzv_id="pipetrain-api")
    assert codes == [0, 0], text
    for name in ("1f1b-fit", "pipedream-step"):
        _assert_same(tmp_path, emulated, name)


def test_step_by_step_pipedream_keeps_the_pipeline_full_and_equals_fit(emulated):
    with open(emulated / "pipedream-step.json") as f:
        stepped = json.load(f)
    with open(emulated / "pipedream-fit.json") as f:
        fitted = json.load(f)
    assert stepped["programs"] == fitted["programs"]  # the very same actions, no flush between calls
    assert stepped["in_flight"][:-1] == [1] * (api_script.STEPS - 1)  # stage 0's warm-up minibatch stays in flight
    assert stepped["in_flight"][-1] == 0  # the last call drains
    _assert_same(emulated, emulated, "pipedream-step")
    a, b = torch.load(emulated / "pipedream-step.pt"), torch.load(emulated / "pipedream-fit.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _plain(model, batches, optimizer, scheduler=None, microbatches=1):
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
            loss = nn.functional.cross_entropy(model(xs), ys) * (len(ys) / len(y))
            loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 4))


def _batches(count=5, size=8):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(size, 6, generator=generator), torch.randint(0, 4, (size,), generator=generator))
            for _ in range(count)]


@pytest.mark.parametrize("cls, options", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (torch.optim.RMSprop, dict(lr=0.01, alpha=0.9)),
    (torch.optim.Adagrad, dict(lr=0.05)),
])
def test_torch_optimizers_equal_plain_pytorch(cls, options):
    batches = _batches()
    reference = _model()
    _plain(reference, batches, cls(reference.parameters(), **options))
    model = _model()
    Pipeline(model, balance=[2, 3], schedule="1f1b", microbatches=1, optimizer=cls, optimizer_options=options,
             executor="emulate").train(batches)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_torch_lr_scheduler_drives_every_stage_like_plain_pytorch():
    batches = _batches(count=6)
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.5)
    _plain(reference, batches, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    for cls in (torch.optim.SGD, torch.optim.RMSprop):
        model = _model()
        options = dict(lr=0.2, momentum=0.5)
        Pipeline(model, balance=[3, 2], schedule="gpipe", microbatches=1, optimizer=cls, optimizer_options=options,
                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                 executor="emulate").train(batches)
        if cls is torch.optim.SGD:
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.equal(p, q)


def test_1f1b_with_microbatches_equals_plain_gradient_accumulation():
    batches = _batches()
    reference = _model()
    _plain(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1), microbatches=4)
    model = _model()
    Pipeline(model, stages=2, schedule="1f1b", microbatches=4, optimizer=torch.optim.SGD,
             optimizer_options=dict(lr=0.1), executor="emulate").train(batches)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class _Recorder(Callback):
    def __init__(self):
        self.updates, self.evaluations, self.ended = [], [], []

    def on_update(self, step, loss):
        self.updates.append((step, loss))

    def on_evaluation(self, step, metrics):
        self.evaluations.append(step)

    def on_end(self, result):
        self.ended.append(result)


def test_fit_calls_back_with_every_update_and_evaluation():
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    recorder = _Recorder()
    plain_calls = []
    pipe = Pipeline(_model(), stages=2, schedule="pipedream", optimizer="sgd:lr=0.05", executor="emulate")
    result = pipe.fit(data, batch_size=8, steps=6, eval_data=data, eval_every=3,
                      callbacks=[recorder, lambda step, loss: plain_calls.append(step)], progress=False)
    assert [s for s, _ in recorder.updates] == list(range(6)) == plain_calls
    assert [loss for _, loss in recorder.updates] == result.update_losses
    assert recorder.evaluations == [3, 6] and recorder.ended == [result]
    assert [e["step"] for e in result.evaluations] == [3, 6]


@pytest.mark.parametrize("model, got", [("notamodule", "not 'notamodule', of type str"),
                                        ([nn.Linear(2, 2), 3], "not a list whose item 1 is of type int")])
def test_a_model_that_is_no_module_is_refused_saying_what_pipeline_takes(model, got):
    with pytest.raises(PipetrainError, match="^Pipeline\\(model\\) takes an nn.Module \\(an nn.Sequential, or any "
                                             "module torch.fx can trace\\) or a list of stage modules, ") as caught:
        Pipeline(model)
    assert str(caught.value).endswith(got)


def test_per_step_mistakes_are_explained():
    pipe = Pipeline(_model(), stages=2, schedule="pipedream", executor="emulate")
    with pytest.raises(PipetrainError, match="start"):
        pipe.step(*_batches(1)[0])
    pipe.start(steps=2, batch_size=8)
    with pytest.raises(PipetrainError, match="batch_size=8"):
        pipe.step(torch.randn(5, 6), torch.zeros(5, dtype=torch.int64))
    pipe.step(*_batches(1)[0])
    with pytest.raises(PipetrainError, match="1 more"):
        pipe.finish()
    pipe.step(*_batches(1)[0])
    with pytest.raises(PipetrainError, match="steps=2"):
        pipe.step(*_batches(1)[0])
    assert len(pipe.finish().update_losses) == 2


def test_a_compensation_beside_an_optimizer_factory_is_refused_not_ignored():
    from pipetrain.optim import build_stage_optimizer

    def factory(stage, delay):
        return build_stage_optimizer("sgd:lr=0.01,momentum=0.9", stage_delay=delay)

    with pytest.raises(PipetrainError, match="give it the compensation .*compensation='sc\\+lwp\\+dts2'"):
        Pipeline(_model(), stages=2, schedule="pb", optimizer=factory, compensation="sc+lwp+dts2", executor="emulate")
    Pipeline(_model(), stages=2, schedule="pb", optimizer=factory, executor="emulate")  # without one: fine


def test_the_distributed_executor_refuses_to_rerun_a_test_runner():
    pipe = Pipeline(_model(), stages=2, schedule="1f1b")
    with pytest.raises(PipetrainError, match="executor='emulate'"):
        pipe.train(_batches(2))


def test_the_heading_says_how_pipeline_cut_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for options, heading in [({"stages": 2}, "stages balanced by parameter count"),
                             ({"balance": [2, 1]}, "stages given by balance=[2, 1]"),
                             ({"split_at": ["2"]}, "stages given by split_at=['2']")]:
        pipe = Pipeline(model, executor="emulate", microbatches=1, **options)
        pipe.start(steps=1, batch_size=2)
        assert pipe._run.stage_choice.heading() == heading
        pipe.step(torch.randn(2, 4), torch.tensor([0, 1]))
        pipe.finish()
    pipe = Pipeline([nn.Linear(4, 8), nn.Linear(8, 2)], executor="emulate", microbatches=1)
    pipe.start(steps=1, batch_size=2)
    assert pipe._run.stage_choice.heading() == "stages given by stage modules"


def test_a_stage_count_beside_a_given_cut_must_agree_with_it():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"^stages=3 disagrees with the 2 stages of balance; drop one of them$"):
        Pipeline(model, stages=3, balance=[2, 1], executor="emulate")
    with pytest.raises(ConfigError, match=r"^stages=3 disagrees with the 2 stages of split_at; drop one of them$"):
        Pipeline(model, stages=3, split_at=["2"], executor="emulate")
    assert len(Pipeline(model, stages=2, balance=[2, 1], executor="emulate").staged.stages) == 2


def test_the_emulator_gives_the_callers_thread_count_back():
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 6, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        pipe = Pipeline(_model(), stages=2, schedule="pipedream", executor="emulate")
        pipe.fit(data, batch_size=8, steps=2, progress=False, quiet=True,
                 callbacks=[lambda step, loss: seen.append(torch.get_num_threads())])
        assert seen == [1, 1]  # trained at a worker's thread count (threads_per_worker)
        assert torch.get_num_threads() == 2
        pipe.start(steps=2, batch_size=8)
        assert torch.get_num_threads() == 1
        for _ in range(2):
            pipe.step(data.tensors[0][:8], data.tensors[1][:8])
        pipe.finish()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _users_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_loss_fn_that_cannot_be_called_is_refused_at_construction_saying_what_to_pass():
    with pytest.raises(ConfigError, match=r"^loss_fn must be called as loss_fn\(output, target\), returning the mean "
                                          r"loss: pass a callable such as torch.nn.MSELoss\(\) or a function, not "
                                          r"str 'mse'$"):
        Pipeline(_users_model(), stages=2, executor="emulate", loss_fn="mse")
    with pytest.raises(ConfigError, match=r"^loss_fn is the class torch.nn.modules.loss.CrossEntropyLoss: pass an "
                                          r"instance, torch.nn.modules.loss.CrossEntropyLoss\(\)$"):
        Pipeline(_users_model(), stages=2, executor="emulate", loss_fn=nn.CrossEntropyLoss)
    losses = Pipeline(_users_model(), stages=2, executor="emulate", loss_fn=nn.CrossEntropyLoss()).train(_batches(1))
    assert len(losses) == 1


@pytest.mark.parametrize("options, message", [
    (dict(microbatches="4"), "Pipeline(): microbatches takes int | None, not str '4'"),
    (dict(split_at="2"), "Pipeline(): split_at takes Sequence[str] | None, not str '2'"),
    (dict(schedule=1), "Pipeline(): schedule takes str | None, not int 1"),
    (dict(replicas=2), "Pipeline(): replicas takes Sequence[int] | None, not int 2"),
    (dict(concrete_args=[1]), "Pipeline(): concrete_args takes dict[str, Any] | None, not list [1]"),
    (dict(compensation=3), "Pipeline(): compensation takes str, not int 3"),
    (dict(timeout="60"), "Pipeline(): timeout takes float, not str '60'"),
    (dict(microbatches=0), "microbatches must be at least 1, got 0"),
    (dict(optimizer="sgd:lr=fast"), "option lr='fast' must be a number, for example lr=0.1"),
    (dict(compensation="xyz"), "unknown delay compensation 'xyz'"),
    (dict(optimizer=torch.optim.SGD, optimizer_options=[0.1]),
     "optimizer_options takes a dict of SGD's keyword arguments, such as dict(lr=0.1), not list [0.1]"),
    (dict(optimizer=torch.optim.SGD, optimizer_options=dict(lrr=0.1)),
     "optimizer SGD does not take optimizer_options={'lrr': 0.1}: TypeError: "),
    (dict(stagez=2), "Pipeline() got an unexpected keyword argument 'stagez'; did you mean 'stages'?"),
])
def test_every_set_up_mistake_of_pipeline_is_a_config_error_at_construction(options, message):
    with pytest.raises(ConfigError) as caught:  # one except clause for every set-up error of a script
        Pipeline(_users_model(), **{"stages": 2, "executor": "emulate", **options})
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize("call, message", [
    (lambda pipe, data: pipe.fit(data, steps="2"), "fit(): steps takes int | None, not str '2'"),
    (lambda pipe, data: pipe.fit(data, batch_size=8.0), "fit(): batch_size takes int | None, not float 8.0"),
    (lambda pipe, data: pipe.fit(data, shuffle="no"), "fit(): shuffle takes bool, not str 'no'"),
    (lambda pipe, data: pipe.fit(data, save=3), "fit(): save takes str | None, not int 3"),
    (lambda pipe, data: pipe.fit(data, callbacks=print_loss), "callbacks takes a list of Callback objects or "
                                                              "functions f(step, loss), not function"),
    (lambda pipe, data: pipe.fit(data, callbacks=[3]), "callbacks: 3, of type int, is neither a Callback"),
    (lambda pipe, data: pipe.start("2", 8), "start(): steps takes int, not str '2'"),
    (lambda pipe, data: pipe.train([data.tensors[0]]), "train() takes (inputs, targets) pairs, one per update; "
                                                       "batch 0 is Tensor tensor("),
])
def test_every_set_up_mistake_of_a_run_is_a_config_error_before_it_trains(call, message):
    from torch.utils.data import TensorDataset

    model = _users_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = TensorDataset(torch.randn(16, 6), torch.randint(0, 4, (16,)))
    with pytest.raises(ConfigError) as caught:
        call(Pipeline(model, stages=2, executor="emulate"), data)
    assert str(caught.value).startswith(message), caught.value
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def print_loss(step, loss):
    print(step, loss)
