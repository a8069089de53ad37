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

from distrain.errors import CommError, ConfigError, DistrainError, RankFailedError, SpawnTimeoutError  # noqa: E402

# The torch-backed names are imported on first use (PEP 562), so that ``import distrain`` (and the commands that
# never touch torch: ``distrain --version``, ``cluster up|down|status|link``, ``data prepare``) do not pay torch's
# import, about 1.7 s of CPU per process on the 2-core host. ``distrain.comm`` etc. read as before.
_LAZY = {"comm": ("distrain.comm", None), "runtime": ("distrain.runtime", None),
         "launch": ("distrain.launch", "launch"), "spawn": ("distrain.launch", "spawn"),
         "Topology": ("distrain.topology", "Topology")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'distrain' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"


def train(*args, **kwargs) -> dict:
    """Train a model on one or many processes: ``distrain.train(model=..., train_data=...,
    loss_fn=..., config=TrainConfig(...))``; see distrain.trainer.loop.train and docs/training.md."""
    from distrain.trainer import train as _train  # imported on use: `import distrain` stays light

    return _train(*args, **kwargs)
__all__ = ["CommError", "ConfigError", "DistrainError", "RankFailedError", "SpawnTimeoutError", "Topology",
           "comm", "launch", "runtime", "spawn", "train"]
