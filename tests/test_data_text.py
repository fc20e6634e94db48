"""Tests of the `text` data set: the stdlib corpus, vocabulary, split, samples, variable lengths."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils.data import Subset

from pipetrain.data import (
    STDLIB_FILES,
    BatchSampler,
    CharVocab,
    DataInfo,
    dataset_info,
    get_batch,
    load_dataset,
    load_text,
    load_train_test,
    stdlib_corpus,
)
from pipetrain.errors import ConfigError


def test_corpus_is_a_fixed_sorted_file_list_and_deterministic():
    assert list(STDLIB_FILES) == sorted(STDLIB_FILES) and len(STDLIB_FILES) == 44
    corpus = stdlib_corpus()
    assert corpus.files == STDLIB_FILES  # all present on this Python
    assert 1_000_000 < len(corpus.text) < 4_000_000
    assert corpus.sha256 == hashlib.sha256(corpus.text.encode("utf-8")).hexdigest()
    assert corpus.text.startswith(open(__import__("abc").__file__, encoding="utf-8").read()[:200])
    assert corpus.tokens.dtype == torch.int64 and corpus.tokens.numel() == len(corpus.text)


def test_train_and_test_split_the_characters():
    corpus = stdlib_corpus()
    train, test = load_train_test("text")
    n = len(corpus.text)
    cut = n - int(n * 0.1)
    assert corpus.train_size == cut
    assert len(train) == (cut - 1) // 64 and len(test) == (n - cut - 1) // 64
    x, y = train[0]
    assert torch.equal(x, corpus.tokens[:64]) and torch.equal(y, corpus.tokens[1:65])
    x, _ = test[0]
    assert torch.equal(x, corpus.tokens[cut : cut + 64])
    assert load_dataset("text:split=val", block_size=32).tokens.numel() == n - cut
    assert len(load_dataset("text:split=all")) == (n - 1) // 64


def test_samples_are_shifted_pairs():
    data = load_text(block_size=16)
    for i in (0, 7, len(data) - 1, -1):
        x, y = data[i]
        assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        data[len(data)]
    assert dataset_info(data) == DataInfo((16,), 96)
    assert "TextBlocks(text:stdlib:train" in repr(data)


def test_vocabulary_encode_decode():
    vocab = CharVocab.ascii()
    assert len(vocab) == 96 and vocab.chars[0] == "\n" and vocab.unknown == "?"
    text = "def f(x):\n    return x ~ 1\n"
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.decode(vocab.encode("a\tb\u00e9")) == "a?b?"  # outside the vocabulary: '?'
    own = CharVocab.from_text("banana")
    assert own.chars == "abn" and own.encode("nab").tolist() == [2, 0, 1] and own.decode([1, 1]) == "bb"
    with pytest.raises(ConfigError, match="'x' is not in the vocabulary"):
        own.encode("bax")
    with pytest.raises(ConfigError, match="distinct"):
        CharVocab("aa")
    with pytest.raises(ConfigError, match="out of range"):
        own.decode([5])
    data = load_text()
    assert data.vocab.decode(data[3][0]) == stdlib_corpus().text[3 * 64 : 4 * 64].replace("\t", "?")


def test_fixed_length_batches_by_default():
    data = load_text(block_size=24)
    x, y = get_batch(data, [5, 2, 9])
    assert x.shape == y.shape == (3, 24)
    assert torch.equal(x[1], data[2][0]) and torch.equal(y[2], data[9][1])


def test_variable_length_batches_are_deterministic():
    data = load_dataset("text:block_size=32,min_length=8")
    sampler = BatchSampler(data, 4, seed=0)
    lengths = []
    for step in range(30):
        index = sampler.indices(step)
        x, y = get_batch(data, index)
        assert x.shape == y.shape and x.shape[0] == 4 and 8 <= x.shape[1] <= 32
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(x[0], data[int(index[0])][0][: x.shape[1]])
        again, _ = get_batch(data, index)
        assert torch.equal(again, x)
        lengths.append(x.shape[1])
    assert len(set(lengths)) > 10  # the length changes from update to update
    assert data.batch_length([1, 2, 3]) == data.batch_length(torch.tensor([1, 2, 3]))
    # a Subset's indices reach the underlying samples
    sub = Subset(data, [10, 11, 12])
    assert torch.equal(get_batch(sub, [0, 2])[0], get_batch(data, [10, 12])[0])


def test_user_text_file(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    train, test = load_train_test(f"text:source={path},block_size=8")
    assert train.num_classes == len(set(path.read_text())) == 28  # 26 letters, space, newline
    assert train.vocab.decode(train[0][0]) == "the quic"
    assert len(train) + len(test) >= (len(path.read_text()) - 2) // 8 - 1


@pytest.mark.parametrize(
    "spec, word",
    [("text:split=dev", "unknown split 'dev'"), ("text:block_size=0", "block_size must be a positive"),
     ("text:block_size=8,min_length=9", "min_length must be an integer in 1..block_size=8"),
     ("text:source=/nonexistent/x.txt", "cannot read it"), ("text:blocksize=8", "Did you mean 'block_size'")],
)
def test_errors(spec, word):
    with pytest.raises(ConfigError, match=word):
        load_dataset(spec)
