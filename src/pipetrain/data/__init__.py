"""Example data sets (`digits`, `synthetic`, `text`, user factories) and the deterministic batch sampler."""

from pipetrain.data.digits import DIGITS_TEST_SIZE, load_digits
from pipetrain.data.info import DataInfo, dataset_info, get_batch
from pipetrain.data.registry import DATASETS, load_dataset, load_train_test, split_indices
from pipetrain.data.sampler import BatchSampler, epoch_seed
from pipetrain.data.synthetic import load_synthetic
from pipetrain.data.tensors import ClassificationTensors
from pipetrain.data.text import STDLIB_FILES, CharVocab, TextBlocks, TextCorpus, load_text, stdlib_corpus

__all__ = [
    "BatchSampler",
    "CharVocab",
    "ClassificationTensors",
    "DATASETS",
    "DIGITS_TEST_SIZE",
    "DataInfo",
    "STDLIB_FILES",
    "TextBlocks",
    "TextCorpus",
    "dataset_info",
    "epoch_seed",
    "get_batch",
    "load_dataset",
    "load_digits",
    "load_synthetic",
    "load_text",
    "load_train_test",
    "split_indices",
    "stdlib_corpus",
]
