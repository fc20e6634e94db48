"""Tests of pipetrain.data.sampler: update t's indices as a pure function of t."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.data import BatchSampler, epoch_seed, load_digits
from pipetrain.errors import ConfigError


def test_no_shuffle_wraps_around_epochs():
    sampler = BatchSampler(5, 2, shuffle=False)
    assert [sampler.indices(t).tolist() for t in range(5)] == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]]
    assert sampler.indices(0).dtype == torch.int64


def test_no_shuffle_update_t_reads_t_times_b():
    sampler = BatchSampler(load_digits("train"), 32, shuffle=False)
    for t in (0, 1, 44, 45, 1000):
        expected = [(t * 32 + i) % 1437 for i in range(32)]
        assert sampler.indices(t).tolist() == expected


def test_shuffle_uses_seeded_generator_per_epoch():
    sampler = BatchSampler(10, 5, seed=3)
    for epoch in range(3):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(epoch_seed(3, epoch)))
        assert torch.equal(sampler.epoch_order(epoch), expected)
    assert torch.equal(torch.cat([sampler.indices(2), sampler.indices(3)]), sampler.epoch_order(1))
    assert epoch_seed(3, 2) == epoch_seed(3, 2) < 2**32
    assert len({epoch_seed(s, e) for s in range(20) for e in range(20)}) == 400


def test_seeds_differ_and_epochs_differ():
    a, b = BatchSampler(100, 10, seed=0), BatchSampler(100, 10, seed=1)
    assert not torch.equal(a.epoch_order(0), b.epoch_order(0))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))


def test_sampling_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    BatchSampler(50, 7, seed=9).indices(20)
    assert torch.equal(torch.rand(3), expected)


def test_resume_from_any_update_matches_uninterrupted_run():
    uninterrupted = [t.tolist() for t in BatchSampler(37, 8, seed=5).iter_from(0, 30)]
    first = BatchSampler(37, 8, seed=5)
    head = [t.tolist() for t in first.iter_from(0, 13)]
    state = first.state_dict(13)
    resumed = BatchSampler(37, 8, seed=5)
    start = resumed.check_resume(state)
    tail = [t.tolist() for t in resumed.iter_from(start, 17)]
    assert head + tail == uninterrupted
    # random access in any order gives the same answer
    fresh = BatchSampler(37, 8, seed=5)
    assert [fresh.indices(t).tolist() for t in reversed(range(30))] == uninterrupted[::-1]


def test_check_resume_rejects_other_settings():
    state = BatchSampler(37, 8, seed=5).state_dict(3)
    with pytest.raises(ConfigError, match="batch_size=8"):
        BatchSampler(37, 4, seed=5).check_resume(state)
    with pytest.raises(ConfigError, match="seed"):
        BatchSampler(37, 8, seed=6).check_resume(state)


def test_epochs_and_positions():
    sampler = BatchSampler(10, 4, shuffle=False)
    assert sampler.steps_per_epoch == 2.5
    assert sampler.steps_for_epochs(1) == 3 and sampler.steps_for_epochs(2) == 5
    assert sampler.position(0) == (0, 0) and sampler.position(3) == (1, 2)


def test_batch_larger_than_data_spans_epochs():
    sampler = BatchSampler(3, 7, shuffle=False)
    assert sampler.indices(1).tolist() == [1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("kwargs, word", [({"batch_size": 0}, "batch_size"), ({"batch_size": 2, "seed": -1}, "seed")])
def test_bad_arguments(kwargs, word):
    with pytest.raises(ConfigError, match=word) as raised:
        BatchSampler(10, **kwargs)
    assert raised.value.options == (word,)
    with pytest.raises(ConfigError, match="empty"):
        BatchSampler(0, 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2**32 - 1), st.booleans())
def test_stream_is_concatenated_epoch_orders(n, b, seed, shuffle):
    sampler = BatchSampler(n, b, seed=seed, shuffle=shuffle)
    epochs = 3
    steps = epochs * n // b
    stream = torch.cat([sampler.indices(t) for t in range(steps)]) if steps else torch.empty(0, dtype=torch.int64)
    orders = torch.cat([sampler.epoch_order(e) for e in range(epochs)])
    assert torch.equal(stream, orders[: steps * b])
    for e in range(epochs):
        assert sorted(sampler.epoch_order(e).tolist()) == list(range(n))
