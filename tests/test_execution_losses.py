"""UnitLosses: a unit -> loss mapping in arrays that behaves as the dictionary it replaces."""

import math
import pickle

import pytest

from pipetrain.execution.losses import UnitLosses


def test_unit_losses_behave_as_a_dictionary():
    losses = UnitLosses()
    reference = {}
    for unit, loss in [(3, 0.5), (0, 1.25), (10, float("nan")), (3, 0.75), (1000, -2.0)]:
        losses[unit] = reference[unit] = loss
    assert len(losses) == len(reference) == 4
    assert sorted(losses) == sorted(reference) == [0, 3, 10, 1000]
    assert losses[3] == 0.75 and math.isnan(losses[10])  # a non-finite loss is held as it is
    assert 5 not in losses and -1 not in losses and "3" not in losses
    with pytest.raises(KeyError):
        losses[5]
    del losses[10], reference[10]
    assert losses == reference and reference == losses and dict(losses) == reference
    again = pickle.loads(pickle.dumps(losses))
    assert isinstance(again, UnitLosses) and again == reference
    assert len(pickle.dumps(losses)) < 9 * 1001 + 300  # 9 bytes a unit up to the last one held, no spare room
    again[5000] = 3.0  # a rebuilt record grows as any
    assert again[5000] == 3.0 and len(again) == 4 and again == {**reference, 5000: 3.0}
    del again[5000]
    assert UnitLosses(reference) == reference
    merged = UnitLosses({1: 1.0})
    merged.update(again)
    assert merged == {**reference, 1: 1.0}
