"""What the loop trains on: the data, the loss, and the optimizer factory.

A ``Task`` holds the train and validation sets, the loss function and what one sample
counts (``tokens`` of ``block_size`` for text, ``samples`` for images); the batch of step
``s`` comes from ``DistributedBatchSampler`` (a pure function of seed and step), so every
engine reads the same global batches whatever its number of ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from distrain import runtime
from distrain.data import load_digits, load_fashion_mnist, load_text_datasets
from distrain.data.vocab import shard_folder, vocab_error
from distrain.errors import ConfigError
from distrain.models import classification_loss, lm_loss
from distrain.optim import make_optimizer
from distrain.trainer.config import TrainConfig


@dataclass
class Task:
    """What the loop needs to know about the data: batches, loss, and what a sample counts."""

    train: object
    val: object
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit: str  # "tokens" or "samples"
    units_per_sample: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")  # batches are moved here (the rank's device)

    def batch(self, ds, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = ds.get_batch(idx)
        x = x.to(self.device, self.dtype) if x.is_floating_point() else x.to(self.device)
        return x, y.to(self.device)

    @property
    def tokenizer(self):
        """The text's tokenizer (encode/decode): a shard folder's, or bytes; None for other data."""
        from distrain.data.shards import ShardDataset, shard_tokenizer
        from distrain.data.tokenizer import ByteTokenizer

        if isinstance(self.train, ShardDataset):
            return shard_tokenizer(self.train.folder, self.train.meta)
        return ByteTokenizer() if self.unit == "tokens" else None

    def val_batches(self, batch_size: int, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``count`` validation batches (the same every time, wrapping around)."""
        n = len(self.val)
        for b in range(count):
            yield self.batch(self.val, torch.arange(b * batch_size, (b + 1) * batch_size) % n)


def build_task(cfg: TrainConfig, block_size: int | None, device: torch.device = torch.device("cpu"),
               parts=None) -> Task:
    """The config's data set, or the user's (``parts``: trainer.custom.UserParts)."""
    dtype = getattr(torch, cfg.dtype)
    if parts is not None and parts.train_data is not None:
        return Task(parts.train_data, parts.val_data, loss_function(cfg, parts), "samples", 1, dtype, device)
    if cfg.data_kind == "text" and shard_folder(cfg) is not None:  # token shards (distrain data prepare)
        from distrain.data.shards import load_shard_datasets

        train, val = load_shard_datasets(cfg.data, block_size=block_size)
        record_data(cfg, train.meta)
        return Task(train, val, lm_loss, "tokens", block_size, dtype, device)
    if cfg.data_kind == "text":
        train, val = load_text_datasets(None if cfg.data == "shakespeare" else cfg.data, block_size=block_size)
        return Task(train, val, lm_loss, "tokens", block_size, dtype, device)
    if cfg.data == "fashion-mnist":  # ($DISTRAIN_FASHION_MNIST, read at the process edge)
        train, val = load_fashion_mnist(runtime.validate_args()["fashion_mnist_root"])
    else:
        train, val = load_digits()
    return Task(train, val, classification_loss, "samples", 1, dtype, device)


# -- token shards: the model's vocabulary, and what the run records of its data ----------------
DATA_RECORD = "data.json"  # in --out: the shard folder and its tokenizer's fingerprint (checked on --resume)


def model_vocab_size(model) -> int | None:
    """The number of token ids ``model`` embeds: ``model.config.vocab_size``, else its first nn.Embedding's rows."""
    n = getattr(getattr(model, "config", None), "vocab_size", None)
    if n is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        n = emb.num_embeddings if emb is not None else None
    return None if n is None else int(n)


def check_model_vocab(cfg: TrainConfig, model) -> None:
    """A shard folder's token ids must index ``model``'s embedding (your own model: before any step)."""
    from distrain.data.shards import read_meta

    folder = shard_folder(cfg)
    n = model_vocab_size(model) if folder is not None else None
    if n is not None:
        meta = read_meta(folder, check_files=False)
        if n < int(meta["vocab_size"]):
            raise ConfigError(vocab_error(cfg, n, meta))


def record_data(cfg: TrainConfig, meta: dict) -> None:
    """Rank 0: write ``--out/data.json`` (the shard folder, its tokenizer spec and fingerprint) and a copy of
    its tokenizer.json as ``--out/tokenizer.json``, so --resume can check the data and ``distrain generate``
    decodes with the run's tokenizer even once the shards are gone."""
    launched = runtime.launched_rank()
    if launched is not None and launched[0] != 0:
        return
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(cfg.data)
    record = {"data": cfg.data, "path": str(folder.resolve()), "tokenizer": meta["tokenizer"]["spec"],
              "vocab_size": meta["vocab_size"], "fingerprint": meta["fingerprint"], "tokens": meta["tokens"]}
    tmp = out / f".{DATA_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out / DATA_RECORD)
    src = folder / meta["tokenizer"].get("file", "tokenizer.json")
    if src.is_file():
        tmp = out / ".tokenizer.json.tmp"
        shutil.copyfile(src, tmp)
        os.replace(tmp, out / "tokenizer.json")


def check_resume_data(cfg: TrainConfig) -> None:
    """--resume on a shard folder: its tokenizer must be the one the run trained with (same fingerprint)."""
    from distrain.data.shards import read_meta

    folder = shard_folder(cfg)
    where = Path(cfg.out) / DATA_RECORD
    if folder is None or not where.is_file():
        return
    recorded = json.loads(where.read_text())
    meta = read_meta(folder, check_files=False)
    if recorded.get("fingerprint") != meta["fingerprint"]:
        raise ConfigError(
            f"--resume: shard folder {folder} was tokenized with {meta['tokenizer']['spec']} (fingerprint "
            f"{meta['fingerprint'][:12]}) but the run in {cfg.out} trained on {recorded.get('tokenizer')} (fingerprint "
            f"{str(recorded.get('fingerprint'))[:12]}, {where}): its token ids mean other things; resume on the shard "
            f"folder the run trained on, or start a new run with another --out")


def loss_function(cfg: TrainConfig, parts=None):
    """The user's loss, the one --loss names, or the data's: next-token cross-entropy for text,
    cross-entropy over classes otherwise."""
    from distrain.trainer.custom import builtin_loss

    if parts is not None and parts.loss_fn is not None:
        return parts.loss_fn
    if cfg.loss != "auto":
        return builtin_loss(cfg.loss)
    if cfg.data_kind == "text":
        return lm_loss
    return classification_loss if cfg.data_kind != "custom" else builtin_loss("cross-entropy")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of ``step`` (a pure function of the step, so a resumed run continues it).

    Linear warm-up over ``warmup_steps`` (step s gets lr * (s + 1) / warmup), then constant,
    or cosine decay (Loshchilov & Hutter, SGDR, 2017) from lr at the end of the warm-up to
    min_lr at the last step: min_lr + (lr - min_lr) * (1 + cos(pi * k / K)) / 2, k steps after
    the warm-up of K = steps - warmup."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    if cfg.lr_schedule == "constant":
        return cfg.lr
    k, total = step - w, max(1, cfg.steps - w)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * k / total)) / 2


def build_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` (--optimizer, --lr, --weight-decay, --momentum: distrain.optim)."""
    return make_optimizer(cfg.optimizer, params, cfg.lr, cfg.weight_decay, cfg.momentum)
