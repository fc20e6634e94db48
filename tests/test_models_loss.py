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
