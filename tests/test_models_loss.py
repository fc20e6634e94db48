"""Tests of the shared loss and metrics: classification and per-token cross entropy, evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.data import load_digits, load_text
from pipetrain.errors import ConfigError
from pipetrain.models import accuracy_counts, build_model, cross_entropy, evaluate, loss_for
from pipetrain.stages import split_model


def test_cross_entropy_classification_and_sequences():
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    assert torch.equal(cross_entropy(logits, labels), F.cross_entropy(logits, labels))
    seq, targets = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    torch.testing.assert_close(cross_entropy(seq, targets), F.cross_entropy(seq.transpose(1, 2), targets))
    with pytest.raises(ConfigError, match="one more dimension"):
        cross_entropy(seq, targets[0])
    with pytest.raises(ConfigError, match="does not match"):
        cross_entropy(seq, targets[:, :3])


def test_accuracy_counts():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0]], [[0.0, 3.0], [1.0, 0.0]]])
    assert accuracy_counts(logits, torch.tensor([[1, 0], [0, 0]])) == (3, 4)


def test_loss_for_uses_a_models_own_loss():
    assert loss_for(nn.Linear(2, 2)) is cross_entropy and loss_for() is cross_entropy
    model = nn.Linear(2, 2)
    model.pipeline_loss = F.mse_loss
    assert loss_for(model) is F.mse_loss


def test_evaluate_classifier_and_its_stages():
    model = build_model("resnet-gn-skip:blocks=1/1,channels=8,groups=2", input_shape=(64,), num_classes=10, seed=0)
    test = load_digits("test")
    result = evaluate(model, test, batch_size=100)
    x, y = test.features, test.labels
    with torch.no_grad():
        out = model(x)
    assert result["samples"] == result["targets"] == 360
    assert result["loss"] == pytest.approx(float(cross_entropy(out, y)), rel=1e-5)
    assert result["accuracy"] == accuracy_counts(out, y)[0] / 360
    staged = evaluate(split_model(model, stages=2), test, batch_size=64)
    assert staged["loss"] == pytest.approx(result["loss"], rel=1e-6)


def test_evaluate_text_in_bits_per_character():
    data = load_text(block_size=8, split="test")
    small = torch.utils.data.Subset(data, range(20))
    model = build_model("gpt:n_layer=1,n_embd=16,n_head=2", input_shape=(8,), num_classes=96, seed=0)
    result = evaluate(model, small, batch_size=7)
    assert result["targets"] == 20 * 8
    assert result["bits_per_target"] == pytest.approx(result["loss"] / math.log(2))
    assert abs(result["loss"] - math.log(96)) < 0.2
    assert model.training


def test_ignored_targets_count_for_nothing():
    from pipetrain.models import CrossEntropy

    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, :3] = -100
    loss = cross_entropy(logits, targets)
    keep = targets != -100
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], targets[keep]))
    assert cross_entropy.count(logits, targets) == 7
    loss.backward()
    assert torch.count_nonzero(logits.grad[0, :3]) == 0
    correct = int((logits.argmax(-1) == targets)[keep].sum())
    assert accuracy_counts(logits, targets) == (correct, 7)
    none = torch.full((2, 5), -100)
    logits.grad = None
    empty = CrossEntropy()(logits, none)  # a microbatch of padding only: 0, not NaN
    empty.backward()
    assert float(empty.detach()) == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_a_shifted_loss_and_its_accuracy_compare_the_next_target():
    from pipetrain.models import CrossEntropy

    shifted = CrossEntropy(shift=1)
    logits, ids = torch.randn(3, 6, 9), torch.randint(0, 9, (3, 6))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 9), ids[:, 1:].reshape(-1))
    assert torch.equal(shifted(logits, ids), expected)
    right = int((logits[:, :-1].argmax(-1) == ids[:, 1:]).sum())
    assert accuracy_counts(logits, ids, shifted) == (right, 15) and shifted.count(logits, ids) == 15
    # a model that predicts the next token perfectly is 100 % accurate only when compared shifted
    perfect = F.one_hot(torch.roll(ids, -1, dims=1), 9).float() * 10
    assert accuracy_counts(perfect, ids, shifted) == (15, 15)
    assert accuracy_counts(perfect, ids)[0] < 18
    with pytest.raises(ConfigError, match="dimension 1"):
        shifted(torch.randn(4, 9), torch.randint(0, 9, (4,)))


def test_held_out_metrics_follow_the_loss():
    from pipetrain.models import CrossEntropy
    from pipetrain.training.evaluate import evaluate_chain

    shifted = CrossEntropy(shift=1)
    g = torch.Generator().manual_seed(0)
    batches = []
    for size in (2, 3):
        ids = torch.randint(0, 5, (size, 4), generator=g)
        ids[0, 2:] = -100  # padding
        batches.append((ids, ids))
    table = torch.randn(5, 5, generator=g)
    forward = lambda ids: table[ids.clamp(min=0)]  # noqa: E731
    result = evaluate_chain(forward, batches, shifted)
    logits = torch.cat([forward(x)[:, :-1].reshape(-1, 5) for x, _ in batches])
    labels = torch.cat([y[:, 1:].reshape(-1) for _, y in batches])
    keep = labels != -100
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits[keep], labels[keep])), rel=1e-6)
    assert result["accuracy"] == int((logits.argmax(-1) == labels)[keep].sum()) / int(keep.sum())


def test_data_sets_may_hold_ignore_labels_but_no_other_negative_ones():
    from torch.utils.data import TensorDataset

    from pipetrain.data import dataset_info

    y = torch.tensor([[1, 4, -100], [2, -100, -100]])
    assert dataset_info(TensorDataset(torch.zeros(2, 3, dtype=torch.long), y)).num_classes == 5
    with pytest.raises(ConfigError, match="negative class label \\(-1\\).*-100"):
        dataset_info(TensorDataset(torch.zeros(2, 1), torch.tensor([0, -1])))
    with pytest.raises(ConfigError, match="every label"):
        dataset_info(TensorDataset(torch.zeros(2, 1), torch.tensor([-100, -100])))


def test_training_with_ignore_labels_equals_plain_training():
    """One microbatch per step: the pipeline's mean over counted tokens is plain training's, bitwise."""
    from pipetrain import Pipeline

    torch.manual_seed(0)
    model = build_model("gpt:n_layer=2,n_embd=16,n_head=2", input_shape=(8,), num_classes=11, seed=0).double()
    import copy

    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(3):
        x = torch.randint(0, 11, (4, 8), generator=g)
        y = torch.randint(0, 11, (4, 8), generator=g)
        y[:, 5:] = -100
        data.append((x, y))
    Pipeline(model, executor="emulate", stages=2, schedule="1f1b", microbatches=1, optimizer="sgd:lr=0.1").train(data)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        opt.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
