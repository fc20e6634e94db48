"""The `text` data set: next-character prediction over a corpus that every machine has offline.

``text:source=stdlib`` (the default) is a fixed, sorted list of modules of the Python standard
library (:data:`STDLIB_FILES`, read from ``sysconfig.get_paths()["stdlib"]``), concatenated in
that order: about 1.9 MB of Python source, the same on every machine with the same Python version
(:func:`stdlib_corpus` reports the files and a SHA-256 of the text). Its vocabulary is fixed:
newline and the 95 printable ASCII characters (96 tokens); any other character (a tab, a few
accented letters in comments) reads as ``?``. ``text:source=PATH`` reads a UTF-8 file instead,
with the sorted set of its characters as the vocabulary.

Split (fixed): the first 90 % of the characters are ``train``, the last 10 % ``test`` (alias
``val``). Sample ``i`` of a split is the window ``tokens[i*T : i*T + T + 1]`` with ``T =
block_size``: ``x`` its first ``T`` tokens, ``y`` its last ``T`` (``x`` shifted by one), both
int64; there are ``(len(tokens) - 1) // T`` samples.

**Variable-length batches**: with ``min_length=L``, a batch built by :meth:`TextBlocks.batch`
(which :func:`pipetrain.data.get_batch` uses) is cut to a length drawn from ``L..T`` by the
batch's sample indices: ``L + SeedSequence(indices).generate_state(1)[0] % (T - L + 1)``. The same
indices always give the same length, on every process, so an executor that builds each update's
batch from its indices and then splits it into microbatches gets equal shapes within an update
and shapes that change from update to update.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from pipetrain.errors import ConfigError

__all__ = [
    "CharVocab",
    "STDLIB_FILES",
    "TEST_FRACTION",
    "TextBlocks",
    "TextCorpus",
    "load_text",
    "stdlib_corpus",
]

#: Standard-library modules of the `stdlib` corpus, in order (present in Python 3.8 to 3.13).
STDLIB_FILES: tuple[str, ...] = tuple(
    f"{name}.py"
    for name in (
        "abc argparse ast base64 bisect calendar colorsys configparser contextlib copy csv "
        "dataclasses datetime difflib enum fnmatch fractions functools gettext glob heapq hmac "
        "inspect ipaddress locale operator os pickle pprint queue random shutil statistics string "
        "subprocess tarfile textwrap threading tokenize traceback typing uuid warnings weakref"
    ).split()
)

#: Share of the characters (at the end of the corpus) held out as the `test` split.
TEST_FRACTION = 0.1

_SPLITS = ("train", "test", "val", "all")


class CharVocab:
    """Characters <-> token ids: ``encode(str) -> int64 tensor``, ``decode(ids) -> str``.

    ``unknown``, when set, is the character that every character outside the vocabulary is read
    as; without it such a character is an error.
    """

    def __init__(self, chars: Iterable[str], unknown: str | None = None):
        self.chars = "".join(chars)
        if not self.chars or len(set(self.chars)) != len(self.chars):
            raise ConfigError("a vocabulary needs distinct characters, at least one")
        if unknown is not None and unknown not in self.chars:
            raise ConfigError(f"the unknown character {unknown!r} is not in the vocabulary")
        self.unknown = unknown
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        codes = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)
        self._table = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
        self._table[codes] = np.arange(len(self.chars))

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        """The sorted set of the characters of ``text``."""
        return cls(sorted(set(text)))

    @classmethod
    def ascii(cls) -> "CharVocab":
        """Newline and printable ASCII (96 characters); everything else reads as ``?``."""
        return cls("\n" + "".join(chr(i) for i in range(32, 127)), unknown="?")

    def __len__(self) -> int:
        return len(self.chars)

    def __repr__(self) -> str:
        return f"CharVocab({len(self)} characters)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and (self.chars, self.unknown) == (other.chars, other.unknown)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64, shape ``(len(text),)``) of ``text``."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(codes.shape, -1, dtype=np.int64)
        inside = codes < len(self._table)
        ids[inside] = self._table[codes[inside]]
        missing = ids < 0
        if missing.any():
            if self.unknown is None:
                bad = text[int(np.argmax(missing))]
                raise ConfigError(f"character {bad!r} is not in the vocabulary of {len(self)} characters")
            ids[missing] = self.stoi[self.unknown]
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of token ids (a 1-d tensor or a sequence of ints)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        try:
            return "".join(self.chars[int(i)] for i in values)
        except IndexError:
            raise ConfigError(f"token id out of range for a vocabulary of {len(self)} characters") from None


@dataclass(frozen=True)
class TextCorpus:
    """A whole corpus: its text, vocabulary, token ids and where it came from."""

    text: str
    vocab: CharVocab
    tokens: torch.Tensor
    source: str
    files: tuple[str, ...]
    sha256: str

    @property
    def train_size(self) -> int:
        """Number of characters of the train split (the rest are the test split)."""
        return len(self.text) - int(len(self.text) * TEST_FRACTION)


def _corpus(text: str, vocab: CharVocab, source: str, files: tuple[str, ...]) -> TextCorpus:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return TextCorpus(text, vocab, vocab.encode(text), source, files, digest)


@functools.lru_cache(maxsize=2)
def stdlib_corpus() -> TextCorpus:
    """The `stdlib` corpus (cached): :data:`STDLIB_FILES` that exist, concatenated in order."""
    root = sysconfig.get_paths()["stdlib"]
    parts: list[str] = []
    found: list[str] = []
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                parts.append(handle.read())
            found.append(name)
    if len(found) < len(STDLIB_FILES) // 2:
        raise ConfigError(
            f"text:source=stdlib found only {len(found)} of {len(STDLIB_FILES)} standard-library files "
            f"under {root}; give text:source=PATH to a text file instead"
        )
    return _corpus("".join(parts), CharVocab.ascii(), "stdlib", tuple(found))


@functools.lru_cache(maxsize=2)
def _file_corpus(path: str) -> TextCorpus:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"text:source={path}: cannot read it as UTF-8 text ({error})") from error
    if len(text) < 2:
        raise ConfigError(f"text:source={path}: the file has fewer than 2 characters")
    return _corpus(text, CharVocab.from_text(text), path, (os.path.basename(path),))


class TextBlocks(Dataset):
    """``(x, y)`` next-token pairs: non-overlapping windows of ``block_size`` over a token stream.

    ``num_classes`` is the vocabulary size (what the model's output layer needs). With
    ``min_length``, :meth:`batch` cuts each batch to a length drawn from its indices.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        vocab: CharVocab,
        block_size: int,
        *,
        min_length: int | None = None,
        name: str = "text",
    ):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"text: block_size must be a positive integer, got {block_size!r}")
        if min_length is not None and (
            not isinstance(min_length, int) or isinstance(min_length, bool) or not 1 <= min_length <= block_size
        ):
            raise ConfigError(f"text: min_length must be an integer in 1..block_size={block_size}, got {min_length!r}")
        if tokens.numel() < block_size + 1:
            raise ConfigError(
                f"text: {tokens.numel()} characters are too few for one sample of block_size={block_size}"
            )
        self.tokens = tokens
        self.vocab = vocab
        self.block_size = block_size
        self.min_length = min_length
        self.num_classes = len(vocab)
        self.name = name
        self._count = (tokens.numel() - 1) // block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        lengths = f"length {self.min_length}..{self.block_size}" if self.min_length else f"length {self.block_size}"
        return f"TextBlocks({self.name}: {len(self)} samples, {lengths}, {len(self.vocab)} characters)"

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        start = (index % len(self)) * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]

    def batch_length(self, indices: torch.Tensor | Sequence[int]) -> int:
        """Sequence length of the batch of ``indices``: ``block_size``, or drawn with ``min_length``."""
        if self.min_length is None:
            return self.block_size
        values = [int(i) % len(self) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        if not values:
            raise ConfigError("a batch needs at least one sample")
        span = self.block_size - self.min_length + 1
        return self.min_length + int(np.random.SeedSequence(values).generate_state(1)[0]) % span

    def batch(self, indices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` stacked into ``(x, y)`` of shape ``(B, batch_length(indices))``."""
        index = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if index.numel() and not (-len(self) <= int(index.min()) and int(index.max()) < len(self)):
            raise IndexError(f"sample indices out of range for {len(self)} samples")
        index = index % len(self)
        windows = self.tokens[index[:, None] * self.block_size + self._offsets]
        length = self.batch_length(index)
        return windows[:, :length], windows[:, 1 : length + 1]


def load_text(
    source: str = "stdlib",
    block_size: int = 64,
    split: str = "train",
    min_length: int | None = None,
) -> TextBlocks:
    """The `text` data set: ``source`` ``stdlib`` or a UTF-8 file path; see the module docstring."""
    if split not in _SPLITS:
        raise ConfigError(f"text: unknown split {split!r}; use one of {', '.join(_SPLITS)}")
    corpus = stdlib_corpus() if source == "stdlib" else _file_corpus(str(source))
    cut = corpus.train_size
    tokens = {"train": corpus.tokens[:cut], "all": corpus.tokens}.get(split, corpus.tokens[cut:])
    label = "stdlib" if source == "stdlib" else os.path.basename(str(source))
    name = f"text:{label}:{'test' if split == 'val' else split}"
    return TextBlocks(tokens, corpus.vocab, block_size, min_length=min_length, name=name)
