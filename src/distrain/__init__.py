"""distrain: distributed training for PyTorch on torch.distributed."""

__version__ = "0.1.0"
