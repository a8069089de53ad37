"""distrain.trainer: the training loop, its typed config, checkpoints and metrics."""

from distrain.trainer.config import TrainConfig
from distrain.trainer.loop import train

__all__ = ["TrainConfig", "train"]
