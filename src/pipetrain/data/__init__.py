"""Example data sets (`digits`, `synthetic`, `text`, user factories), the deterministic batch
sampler, and reading each update's batch (from a Dataset or a user's DataLoader)."""

from pipetrain.data.batches import DEFAULT_WORKERS, DatasetBatches
from pipetrain.data.digits import DIGITS_TEST_SIZE, load_digits
from pipetrain.data.info import DataInfo, dataset_info, get_batch
from pipetrain.data.loader import LoaderBatches
from pipetrain.data.registry import DATASETS, RunData, load_data, load_dataset, load_train_test, split_indices
from pipetrain.data.sampler import BatchSampler, epoch_seed
from pipetrain.data.seeding import data_seed, seeded
from pipetrain.data.synthetic import load_synthetic
from pipetrain.data.tensors import ClassificationTensors
from pipetrain.data.text import STDLIB_FILES, CharVocab, TextBlocks, TextCorpus, load_text, stdlib_corpus
from pipetrain.data.updates import DataReadError, UpdateBatches

__all__ = [
    "BatchSampler",
    "CharVocab",
    "ClassificationTensors",
    "DATASETS",
    "DEFAULT_WORKERS",
    "DIGITS_TEST_SIZE",
    "DataInfo",
    "DataReadError",
    "DatasetBatches",
    "LoaderBatches",
    "RunData",
    "STDLIB_FILES",
    "TextBlocks",
    "TextCorpus",
    "UpdateBatches",
    "data_seed",
    "dataset_info",
    "epoch_seed",
    "get_batch",
    "load_data",
    "load_dataset",
    "load_digits",
    "load_synthetic",
    "load_text",
    "load_train_test",
    "seeded",
    "split_indices",
    "stdlib_corpus",
]
