"""The non-finite guard on its own: the loss test and its words, the skip decision and its limit,
the weights refused."""

from __future__ import annotations

import pytest
import torch

from pipetrain.errors import NonFiniteError, PipetrainError
from pipetrain.execution.nonfinite import SKIP_LIMIT, NonFiniteGuard, finite_loss, nonfinite_kind, nonfinite_names
from pipetrain.execution.version_store import VersionStore

NAN, INF = float("nan"), float("inf")


def test_the_kind_and_the_names_of_values_that_are_not_finite():
    assert nonfinite_kind(torch.tensor([1.0, INF, NAN])) == "nan"
    assert nonfinite_kind(torch.tensor([1.0, -INF])) == "inf"
    assert nonfinite_kind(torch.ones(2)) is None
    tensors = {f"{i}.weight": torch.tensor([NAN if i % 2 else INF]) for i in range(5)}
    tensors["ok"] = torch.ones(1)
    assert nonfinite_names(tensors) == "0.weight (inf), 1.weight (nan), 2.weight (inf) and 2 more"
    assert finite_loss(torch.tensor(2.0)) and not finite_loss(torch.tensor([1.0, NAN]))


def test_an_unknown_mode_says_which_there_are():
    with pytest.raises(PipetrainError, match="nonfinite must be one of stop, skip, off, not 'halt'"):
        NonFiniteGuard(0, "halt")


def test_a_loss_that_is_not_finite_is_traced_to_the_input_the_weights_or_the_stage_itself():
    guard = NonFiniteGuard(2, "stop")
    finite = {"w": torch.ones(2)}
    guard.check_loss(0, torch.tensor(1.0), (torch.ones(2),), finite)  # finite: nothing
    with pytest.raises(NonFiniteError, match=r"stage 2: the loss of microbatch 4 is inf \(its input from stage 1 "
                                             r"already holds nan\)") as caught:
        guard.check_loss(4, torch.tensor(INF), (torch.tensor([NAN]), torch.tensor([3])), finite)
    assert (caught.value.stage, caught.value.microbatch) == (2, 4)
    with pytest.raises(NonFiniteError, match=r"the weights of this stage are not finite in w \(inf\)"):
        guard.check_loss(5, torch.tensor(NAN), (torch.ones(2),), {"w": torch.tensor([INF])})
    with pytest.raises(NonFiniteError, match="its own computation overflowed"):
        guard.check_loss(6, torch.tensor(NAN), (torch.ones(2),), finite)
    with pytest.raises(NonFiniteError, match=r"input from the data"):
        NonFiniteGuard(0, "stop").check_loss(0, torch.tensor(NAN), (torch.tensor([INF]),), finite)
    for mode in ("skip", "off"):  # the loss is tested under stop only
        NonFiniteGuard(2, mode).check_loss(0, torch.tensor(NAN), (torch.ones(2),), finite)


def test_skip_records_each_skipped_update_and_stops_after_the_limit_in_a_row():
    guard = NonFiniteGuard(1, "skip")
    bad, good = {"w": torch.tensor([NAN])}, {"w": torch.ones(1)}
    assert not guard.skips(1, good)
    assert guard.skips(2, bad)
    assert not guard.skips(3, good)  # breaks the row
    for step in range(4, 4 + SKIP_LIMIT - 1):
        assert guard.skips(step, bad)
    with pytest.raises(NonFiniteError, match=f"updates 4 to {3 + SKIP_LIMIT} were all not finite "
                                             r"\(the last in w \(nan\)\)") as caught:
        guard.skips(3 + SKIP_LIMIT, bad)
    assert caught.value.step == 3 + SKIP_LIMIT
    assert guard.skipped == [2, *range(4, 4 + SKIP_LIMIT)]
    assert not NonFiniteGuard(1, "stop").skips(1, bad)  # stop skips nothing (and tests nothing)


def test_weights_that_are_not_finite_are_refused_in_any_held_version_unless_off():
    versions = VersionStore({"w": torch.ones(2)})
    versions.push({"w": torch.tensor([1.0, INF])})
    versions.push({"w": torch.ones(2)})
    NonFiniteGuard(0, "stop").check_weights(VersionStore({"w": torch.ones(2)}), "no checkpoint was written")
    with pytest.raises(NonFiniteError, match=r"stage 3: the weights after update 1 are not finite in w \(inf\); "
                                             r"no checkpoint was written\. .*on_nonfinite='skip' drops") as caught:
        NonFiniteGuard(3, "stop").check_weights(versions, "no checkpoint was written")
    assert caught.value.step == 1
    with pytest.raises(NonFiniteError, match=r"written\. A loss or gradient[^;]*$"):  # skip's advice is not repeated
        NonFiniteGuard(3, "skip").check_weights(versions, "written")
    NonFiniteGuard(3, "off").check_weights(versions, "written")


class Overflows(torch.nn.Module):
    """The user's layer that turns every value into NaN."""

    def forward(self, x):
        return x * float("nan")


def test_with_model_chunks_a_nonfinite_loss_names_the_stages_the_user_asked_for():
    from pipetrain import Pipeline

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)], Overflows(), torch.nn.Linear(4, 3))
    pipe = Pipeline(model, stages=2, schedule="interleaved", chunks=3, microbatches=2, executor="emulate",
                    optimizer="sgd:lr=0.1")
    with pytest.raises(NonFiniteError) as caught:
        pipe.train([(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))])
    assert str(caught.value).startswith("step 1, chunk 2 of stage 1 on rank 1 (5F0@v0): the loss of microbatch 0 is "
                                        "nan (its input from chunk 2 of stage 0 already holds nan)"), caught.value
