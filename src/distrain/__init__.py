"""distrain: distributed training for PyTorch on torch.distributed.

    import distrain
    distrain.spawn(fn, nprocs=4)          # fn(rank) runs on 4 local ranks (Gloo on CPU)
    distrain.comm.all_reduce(t, algorithm="ring")
    distrain.Topology.from_world(dp=2, tp=2)

Old module paths (moved in a redesign) import for one release, with a DeprecationWarning
naming the new one: the table and its finder are distrain.moved, installed here first.
"""

from distrain import moved as _moved

_moved.install()

from distrain import comm, runtime  # noqa: E402  (after the finder: the old paths import from here on)
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
