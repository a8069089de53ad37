"""``--data`` as a token shard folder, and the vocabulary it asks of the model.

Which ``--data`` is a shard folder (:func:`shard_folder`), what a preset takes from it (its
vocabulary, :func:`model_overrides`, by :func:`vocab_override`'s rule) and the error when a model's vocabulary is too small for its
token ids (:func:`vocab_error`). ``cfg`` is a TrainConfig (read by attribute: this module sits below
trainer/config.py, whose validation uses it, and imports nothing above distrain.data).
"""

from __future__ import annotations

from pathlib import Path


def shard_folder(cfg) -> str | None:
    """``--data`` when it is a shard folder (a folder holding meta.json), else None."""
    from distrain.data.shards import is_shard_folder

    return cfg.data if cfg.data_kind == "text" and cfg.data != "shakespeare" and is_shard_folder(cfg.data) else None


def model_overrides(cfg) -> dict:
    """What a preset takes from the data: a shard folder's vocabulary when it exceeds 256 bytes
    (``build_model(cfg.model, **model_overrides(cfg))``; every text preset has a vocab_size); nothing
    otherwise."""
    from distrain.data.shards import read_meta

    folder = shard_folder(cfg)
    if folder is None or cfg.custom_model:
        return {}
    return vocab_override(int(read_meta(folder, check_files=False)["vocab_size"]))


def vocab_override(vocab: int) -> dict:
    """A preset's overrides for a tokenizer of ``vocab`` ids: its vocabulary when it exceeds the 256
    bytes every text preset is built for, nothing otherwise (the trainer's and generate's rule)."""
    return {"vocab_size": vocab} if vocab > 256 else {}


def vocab_error(cfg, model_vocab: int, meta: dict) -> str:
    folder = shard_folder(cfg)
    return (f"--data {folder}: its tokenizer ({meta['tokenizer']['spec']}, {Path(folder) / 'meta.json'}) has "
            f"vocab_size {meta['vocab_size']} but --model {cfg.model} has vocab_size {model_vocab}: token ids would "
            f"fall outside the embedding; build the model with vocab_size >= {meta['vocab_size']} (a preset takes "
            f"the data's vocabulary by itself), or prepare the data with a tokenizer of at most {model_vocab} tokens")
