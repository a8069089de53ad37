"""What the loop trains on: the data, the loss, and the optimizer factory.

A ``Task`` holds the train and validation sets, the loss function and what one sample
counts (``tokens`` of ``block_size`` for text, ``samples`` for images); the batch of step
``s`` comes from ``DistributedBatchSampler`` (a pure function of seed and step), so every
engine reads the same global batches whatever its number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from distrain.data import load_digits, load_fashion_mnist, load_text_datasets
from distrain.models import classification_loss, lm_loss
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
    if cfg.data_kind == "text":
        train, val = load_text_datasets(None if cfg.data == "shakespeare" else cfg.data, block_size=block_size)
        return Task(train, val, lm_loss, "tokens", block_size, dtype, device)
    train, val = load_fashion_mnist() if cfg.data == "fashion-mnist" else load_digits()
    return Task(train, val, classification_loss, "samples", 1, dtype, device)


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
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
