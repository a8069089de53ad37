"""Starting ranks: ``spawn`` (local processes from Python) and ``launch`` (torchrun).

Seeds, "how processes start": either the user's code is the parent and forks a function
into sub-processes (torch.multiprocessing.spawn; here :func:`spawn`, in local.py), or a
launcher is the parent and runs the whole script once per rank (torchrun; here :func:`launch`,
in torchrun.py, which delegates to torch's elastic launcher so multi-node rendezvous and
restarts are torchrun's). rank_exit.py: the exit status a launched rank's command leaves with.
"""

from distrain.launch.local import core_slices, local_env, local_store, spawn
from distrain.launch.torchrun import launch

__all__ = ["core_slices", "launch", "local_env", "local_store", "spawn"]
