"""A stage's forward or loss that fails is explained in one line (`pipetrain.execution.failures`):
the user's exception by its type, message, file and line, and in a run with its step and stage;
an operation that refuses its input by what the stage received; a loss that is not one number by
what to change."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from pipetrain.cli import main
from pipetrain.errors import ModelError
from pipetrain.execution import StageExecutor
from pipetrain.execution.failures import check_loss, forward_failure
from pipetrain.optim import SGD


class Strict(nn.Module):
    def forward(self, x):
        if x.shape[0] > 1:
            raise LookupError("no batches here")  # the user's own exception
        return x


def _failure(module, x):
    try:
        module(x)
    except Exception as error:  # noqa: BLE001
        return forward_failure(1, error, (x,), module, target=torch.zeros(4, dtype=torch.int64))
    raise AssertionError("did not raise")


def test_the_users_exception_is_named_with_its_place_and_module():
    error = _failure(nn.Sequential(nn.Linear(3, 3), Strict()), torch.randn(4, 3))
    line = Strict.forward.__code__.co_firstlineno + 2
    assert str(error) == (f"stage 1: the forward raised LookupError: no batches here "
                          f"(test_execution_failures.py:{line}, in forward) in module '1' (Strict)")


def test_an_operation_that_refuses_its_input_shows_what_the_stage_received():
    error = _failure(nn.Sequential(nn.ReLU(), nn.Linear(5, 3)), torch.randn(4, 3))
    assert str(error).startswith("stage 1 cannot run on its input ((4, 3) float32) from stage 0: RuntimeError: "
                                 "mat1 and mat2 shapes cannot be multiplied (4x3 and 5x3) in module '1' (Linear)")
    assert str(error).endswith("(targets: (4,))")


def test_a_loss_that_is_not_one_number_says_what_to_change():
    with pytest.raises(ModelError, match=r"stage 2: the loss returned a \(4,\) tensor, not one number: return its "
                                         r"mean over the samples \(reduction='mean'"):
        check_loss(2, torch.ones(4))
    with pytest.raises(ModelError, match="returned a float, not one number: return a 0-dim tensor"):
        check_loss(2, 0.5)
    check_loss(2, torch.tensor(0.5))


def test_a_stage_executor_names_the_loss_and_the_microbatch():
    def loss(output, target):
        return {"total": output.sum()}["totl"]

    executor = StageExecutor(0, nn.Linear(3, 2), SGD(lr=0.1), loss_fn=loss)
    with pytest.raises(ModelError, match=r"^stage 0: the loss raised KeyError: 'totl' \(test_execution_failures.py:"
                                         r"\d+, in loss\)$") as caught:
        executor.forward(5, 0, torch.randn(4, 3), target=torch.zeros(4, dtype=torch.int64), samples=4)
    assert caught.value.microbatch == 5


LATE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import Dataset


    class Late(nn.Module):
        def forward(self, x):
            if bool((x == 1000).any()):  # a value: found only when the batch holding it arrives
                raise ArithmeticError("a reading of 1000")
            return x


    def net(in_features, num_classes):
        torch.manual_seed(0)
        return nn.Sequential(Late(), nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))


    class Readings(Dataset):
        num_classes = 3

        def __init__(self, split="train"):
            self.x = torch.zeros(64, 8)
            if split == "train":
                self.x[20, 0] = 1000  # in the third update of 8 samples, in order

        def __len__(self):
            return 64

        def __getitem__(self, i):
            return self.x[i], i % 3
''')


@pytest.mark.parametrize("executor", ["emulate", "distributed"])
def test_a_forward_that_raises_in_training_is_named_with_its_step_and_stage(capfd, tmp_path, monkeypatch, executor):
    (tmp_path / "latenets.py").write_text(LATE)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model", "latenets:net", "--data", "latenets:Readings", "--balance", "2,2",
                 "--batch-size", "8", "--microbatches", "1", "--steps", "4", "--no-shuffle", "--no-progress",
                 "--timeout", "30", "--executor", executor, "--save", "out/m.pt"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.endswith("error: step 3, stage 0 on rank 0 (0F2@v2): the forward raised ArithmeticError: a reading "
                        "of 1000 (latenets.py:10, in forward) in module '0' (Late)\n"), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_forward_errors_names_the_users_exception_and_gives_the_losss_its_microbatch():
    from pipetrain.execution.failures import computed_loss, forward_errors

    module = nn.Linear(3, 2)
    x = torch.ones(4, 5)
    with pytest.raises(ModelError, match=r"stage 1 cannot run on its input \(\(4, 5\) float32\) from stage 0") as caught:
        with forward_errors(1, (x,), module, structure=None, target=None, microbatch=6):
            module(x)
    assert caught.value.microbatch == 6
    with pytest.raises(ModelError, match=r"stage 1: the loss returned a \(4,\) tensor, not one number") as caught:
        with forward_errors(1, (x,), module, structure=None, target=None, microbatch=3):
            computed_loss(1, lambda output, target: output, torch.ones(4), None)
    assert caught.value.microbatch == 3
    assert computed_loss(0, lambda output, target: (output - target).sum(), torch.ones(2), torch.zeros(2)) == 2


def test_located_adds_the_step_the_rank_and_the_action():
    from pipetrain.errors import NonFiniteError
    from pipetrain.execution.failures import located
    from pipetrain.schedule.ir import Action, Kind

    error = NonFiniteError("stage 2: the loss of microbatch 5 is nan", stage=2, microbatch=5)
    action = Action(Kind.F, stage=2, microbatch=5)
    moved = located(error, 3, action, lambda unit: unit // 2)
    assert isinstance(moved, NonFiniteError) and (moved.step, moved.rank, moved.microbatch) == (3, 3, 5)
    assert str(moved).startswith("step 3, stage 2 on rank 3 (") and str(moved).endswith("): the loss of microbatch 5 is nan")


class Refuses(nn.Module):
    """The user's own layer, with a bug."""

    def forward(self, x):
        raise ValueError("my bug")


def _interleaved(model):
    from pipetrain import Pipeline

    return Pipeline(model, stages=2, schedule="interleaved", chunks=3, microbatches=2, executor="emulate",
                    optimizer="sgd:lr=0.1")


def test_with_model_chunks_a_failure_names_the_stage_the_user_asked_for_and_its_chunk():
    # stages=2, chunks=3 cuts the model into 6 pieces; the one that fails is chunk 2 of stage 1, not "stage 5"
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 8, (8,))
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)], Refuses())
    with pytest.raises(ModelError) as caught:  # the set-up check
        _interleaved(model).fit(TensorDataset(x, y), steps=1, batch_size=8, quiet=True)
    assert str(caught.value).startswith("at set-up (on the meta device), on the first training microbatch, the "
                                        "forward of chunk 2 of stage 1 raised ValueError: my bug")
    assert str(caught.value).endswith("in module '5' (Refuses)")
    with pytest.raises(ModelError) as caught:  # in training (batches from the caller's loop skip the check)
        _interleaved(model).train([(x, y)])
    assert str(caught.value).startswith("step 1, chunk 2 of stage 1 on rank 1 (5F0@v0): the forward raised "
                                        "ValueError: my bug"), caught.value

    shapes = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(9, 8), nn.Linear(8, 8))
    with pytest.raises(ModelError) as caught:
        _interleaved(shapes).train([(x, y)])
    assert str(caught.value).startswith("step 1, chunk 2 of stage 0 on rank 0 (4F0@v0): chunk 2 of stage 0 cannot "
                                        "run on its input ((4, 8) float32) from chunk 1 of stage 1: RuntimeError:")
    assert "stage 4" not in str(caught.value) and "stage 3" not in str(caught.value)


def test_stage_names_follow_the_schedules_placement():
    from pipetrain.execution.failures import PLAIN, StageNames
    from pipetrain.schedule import build

    names = StageNames.of(build("interleaved", 2, 4, chunks=3))
    assert [names(p) for p in range(6)] == [f"chunk {c} of stage {s}" for c in range(3) for s in range(2)]
    assert names.input_of(0) == "the data" and names.input_of(3) == "chunk 1 of stage 0"
    assert StageNames.of(build("1f1b", 3, 4)) == PLAIN and PLAIN(2) == "stage 2" and PLAIN.input_of(1) == "stage 0"
