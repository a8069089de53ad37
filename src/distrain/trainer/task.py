"""What the loop trains on: the data, the loss, and the optimizer factory.

A ``Task`` holds the train and validation sets, the loss function and what one sample
counts (``tokens`` of ``block_size`` for text, ``samples`` for images); the batch of step
``s`` comes from ``DistributedBatchSampler`` (a pure function of seed and step), so every
engine reads the same global batches whatever its number of ranks.
"""

from __future__ import annotations

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


def build_task(cfg: TrainConfig, block_size: int | None, device: torch.device = torch.device("cpu")) -> Task:
    dtype = getattr(torch, cfg.dtype)
    if cfg.data_kind == "text":
        train, val = load_text_datasets(None if cfg.data == "shakespeare" else cfg.data, block_size=block_size)
        return Task(train, val, lm_loss, "tokens", block_size, dtype, device)
    train, val = load_fashion_mnist() if cfg.data == "fashion-mnist" else load_digits()
    return Task(train, val, classification_loss, "samples", 1, dtype, device)


def build_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
