"""Starting ranks: ``spawn`` (local processes from Python) and ``launch`` (torchrun).

Seeds, "how processes start": either the user's code is the parent and forks a function
into sub-processes (torch.multiprocessing.spawn; here :func:`spawn`, in local.py), or a
launcher is the parent and runs the whole script once per rank (torchrun; here :func:`launch`,
in torchrun.py, which delegates to torch's elastic launcher so multi-node rendezvous and
restarts are torchrun's). rank_exit.py: the exit status a launched rank's command leaves with.
"""

# imported on first use (PEP 562): rank_exit.py, which every command's entry point imports, needs no torch
_NAMES = {"core_slices": "distrain.launch.local", "local_env": "distrain.launch.local",
          "local_store": "distrain.launch.local", "spawn": "distrain.launch.local", "launch": "distrain.launch.torchrun"}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'distrain.launch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value

__all__ = ["core_slices", "launch", "local_env", "local_store", "spawn"]
