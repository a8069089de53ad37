"""Data for distrain's trainer: byte-level text, image classification, a dp sampler.

Nothing here knows about torch.distributed: ranks and sizes are plain ints.
"""

# The names below are imported on first use (PEP 562): `distrain data prepare` (tokenizers, numpy) needs none of
# the torch datasets, and importing torch costs about 1.7 s of CPU per process on the 2-core host.
_NAMES = {
    "FASHION_MNIST_CLASSES": ("distrain.data.images", "FASHION_MNIST_CLASSES"),
    "FASHION_MNIST_INSTALL": ("distrain.data.images", "FASHION_MNIST_INSTALL"),
    "FASHION_MNIST_ROOT": ("distrain.data.images", "FASHION_MNIST_ROOT"),
    "ArrayDataset": ("distrain.data.images", "ArrayDataset"),
    "load_digits": ("distrain.data.images", "load_digits"),
    "load_fashion_mnist": ("distrain.data.images", "load_fashion_mnist"),
    "parse_idx": ("distrain.data.images", "parse_idx"),
    "read_idx": ("distrain.data.images", "read_idx"),
    "write_idx": ("distrain.data.images", "write_idx"),
    "prepare_shards": ("distrain.data.prepare", "prepare"),
    "DistributedBatchSampler": ("distrain.data.sampler", "DistributedBatchSampler"),
    "ShardDataset": ("distrain.data.shards", "ShardDataset"),
    "is_shard_folder": ("distrain.data.shards", "is_shard_folder"),
    "load_shard_datasets": ("distrain.data.shards", "load_shard_datasets"),
    "read_meta": ("distrain.data.shards", "read_meta"),
    "shard_tokenizer": ("distrain.data.shards", "shard_tokenizer"),
    "SHAKESPEARE_INSTALL": ("distrain.data.text", "SHAKESPEARE_INSTALL"),
    "VOCAB_SIZE": ("distrain.data.text", "VOCAB_SIZE"),
    "ByteTextDataset": ("distrain.data.text", "ByteTextDataset"),
    "corpus_files": ("distrain.data.text", "corpus_files"),
    "decode": ("distrain.data.text", "decode"),
    "encode": ("distrain.data.text", "encode"),
    "load_corpus_bytes": ("distrain.data.text", "load_corpus_bytes"),
    "load_text_datasets": ("distrain.data.text", "load_text_datasets"),
    "shakespeare_files": ("distrain.data.text", "shakespeare_files"),
    "split_bytes": ("distrain.data.text", "split_bytes"),
    "ByteTokenizer": ("distrain.data.tokenizer", "ByteTokenizer"),
    "HFTokenizer": ("distrain.data.tokenizer", "HFTokenizer"),
    "Tokenizer": ("distrain.data.tokenizer", "Tokenizer"),
    "load_tokenizer": ("distrain.data.tokenizer", "load_tokenizer"),
}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'distrain.data' has no attribute {name!r}")
    import importlib

    module, attr = _NAMES[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


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
