"""``distrain.comm`` as a drop-in ``torch.distributed`` module with one algorithm bound.

Used by the conformance harness (torch's own tests) and the tutorial scripts: they call
``dist.all_reduce(t)`` with no ``algorithm=``, so the shim supplies it. Communication
functions come from distrain.comm only (a missing one fails when called, which is what
"missing" means); any other name comes from distrain.comm, else torch.distributed.
"""

from __future__ import annotations

import types

import torch.distributed as _torch_dist

import distrain.comm as _comm

# Everything the tests call that moves data: taken from distrain.comm, bound to the algorithm.
COMM_FUNCTIONS = (
    "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter", "barrier",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced", "all_gather_coalesced",
    "all_to_all", "all_to_all_single", "all_gather_object", "gather_object", "scatter_object_list",
    "broadcast_object_list", "send_object_list", "recv_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "P2POp",
)
TAKES_ALGORITHM = {"broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter",
                   "barrier", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced",
                   "all_gather_coalesced", "all_to_all", "all_to_all_single", "all_gather_object",
                   "gather_object", "scatter_object_list", "broadcast_object_list"}


def _missing(name: str):
    def fail(*args, **kwargs):
        raise AttributeError(f"distrain.comm has no {name}")
    return fail


def _bind(fn, name: str, algorithm: str):
    if name not in TAKES_ALGORITHM:
        return fn

    def bound(*args, **kwargs):
        kwargs.setdefault("algorithm", algorithm)
        return fn(*args, **kwargs)

    bound.__name__ = name
    return bound


def make_shim(algorithm: str) -> types.ModuleType:
    """distrain.comm, its communication functions bound to ``algorithm``, as a module object."""
    shim = types.ModuleType("distrain_comm_" + algorithm)
    for name in COMM_FUNCTIONS:
        fn = getattr(_comm, name, None)
        setattr(shim, name, _missing(name) if fn is None else _bind(fn, name, algorithm))
    # torch's P2POp checks op is torch's isend/irecv; ours takes either, by name
    shim.__getattr__ = lambda n: getattr(_comm, n) if hasattr(_comm, n) else getattr(_torch_dist, n)
    return shim
