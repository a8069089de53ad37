"""distrain: distributed training for PyTorch on torch.distributed.

    import distrain
    distrain.spawn(fn, nprocs=4)          # fn(rank) runs on 4 local ranks (Gloo on CPU)
    distrain.comm.all_reduce(t, algorithm="ring")
    distrain.Topology.from_world(dp=2, tp=2)
"""

from distrain import comm, runtime
from distrain.errors import CommError, ConfigError, DistrainError, RankFailedError, SpawnTimeoutError
from distrain.launch import launch, spawn
from distrain.topology import Topology

__version__ = "0.1.0"


def train(*args, **kwargs) -> dict:
    """Train a model on one or many processes: ``distrain.train(model=..., train_data=...,
    loss_fn=..., config=TrainConfig(...))``; see distrain.trainer.loop.train and docs/training.md."""
    from distrain.trainer import train as _train  # imported on use: `import distrain` stays light

    return _train(*args, **kwargs)
__all__ = ["CommError", "ConfigError", "DistrainError", "RankFailedError", "SpawnTimeoutError", "Topology",
           "comm", "launch", "runtime", "spawn", "train"]
