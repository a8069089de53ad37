"""distrain.comm: point-to-point messages and the collectives, native or our own.

``import distrain.comm as dist`` serves as ``torch.distributed``: every collective and P2P
function has torch's signature (plus ``algorithm=``), and the process-group functions are
torch's own or thin wrappers (compat.py); any other name falls through to torch.distributed.

Four layers, each a folder; imports run downward only (tests/test_import_graph.py checks):

    core/         groups, tags, ops, P2P, ledger, watchdog, the Transport interface (torch's
                  P2P is built in) and the algorithm registry; imports nothing above it
    algorithms/   star, ring, tree (+ cost.py, their exact traffic); each registers itself;
                  imports core only
    shm/          the shared-memory transport and its direct collectives; registers itself
                  with the core; imports core only (asks the registry for the ring by name)
    (top)         the torch.distributed-shaped surface, which may import all three:
                  dispatch.py  argument checks, debug fingerprint, the dispatcher (ledger,
                               ours, direct or native), async handles
                  api.py       the eight collectives with torch.distributed's signatures
                  group_transport.py  a group's transport (set_transport, transport_of) and its
                               symmetric memory (symmetric_empty, symmetric_peer)
                  forms.py     *_into_tensor / *_tensor / coalesced forms, P2POp, batch_isend_irecv
                  alltoall.py  all_to_all, all_to_all_single (p2p: the direct exchange)
                  objects.py   the object collectives (pickled, torch's API) and the data ones (distrain's own)
                  compat.py    init/destroy_process_group and the pass-through group helpers

Old flat paths (``distrain.comm.ring``, ``distrain.comm.shm_coll``, ...) still import, with
a DeprecationWarning naming the new one (distrain.moved), until the next release.
"""

import torch.distributed as _torch_dist

from distrain.comm import algorithms as _algorithms  # noqa: F401  (registers star, ring, tree)
from distrain.comm import shm as _shm  # noqa: F401  (registers the shared-memory transport)

from distrain.comm.alltoall import all_to_all, all_to_all_single
from distrain.comm.api import (
    ALGORITHM_NAMES,
    COLLECTIVES,
    CommHandle,
    all_gather,
    all_reduce,
    all_reduce_list,
    barrier,
    broadcast,
    debug_enabled,
    gather,
    has_list_all_reduce,
    reduce,
    reduce_scatter,
    scatter,
    set_debug,
)
from distrain.comm.compat import PASSTHROUGH, configure_from_env, destroy_process_group, init_process_group
from distrain.comm.shm.compiled import set_kernels as set_shm_kernels
from distrain.comm.forms import (
    P2POp,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce_coalesced,
    batch_isend_irecv,
    reduce_scatter_tensor,
)
from distrain.comm.core.failures import transport_errors
from distrain.comm.core.group import close_all, close_group, interrupt_all, interrupt_group
from distrain.comm.core.ledger import Counts, Ledger, ledger
from distrain.comm.objects import (
    all_gather_data,
    all_gather_object,
    broadcast_data,
    broadcast_object_list,
    gather_data,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from distrain.comm.core.transport import TRANSPORT_NAMES, Transport, set_default_transport
from distrain.comm.group_transport import set_transport, symmetric_empty, symmetric_peer, transport_of
from distrain.comm.core.p2p import irecv, isend, isend_tensor, recv, recv_tensor, send, send_tensor

globals().update({_n: getattr(_torch_dist, _n) for _n in PASSTHROUGH if hasattr(_torch_dist, _n)})


def __getattr__(name: str):
    """Anything else torch.distributed has (e.g. DeviceMesh helpers) is torch's own."""
    try:
        return getattr(_torch_dist, name)
    except AttributeError:
        raise AttributeError(f"module 'distrain.comm' has no attribute {name!r} (nor has torch.distributed)") from None


__all__ = [
    "ALGORITHM_NAMES", "COLLECTIVES", "CommHandle", "Counts", "Ledger", "P2POp", "TRANSPORT_NAMES", "Transport",
    "all_gather", "all_gather_coalesced", "all_gather_data", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_reduce_list", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_data", "broadcast_object_list", "close_all", "close_group", "configure_from_env", "debug_enabled", "destroy_process_group",
    "gather", "gather_data", "gather_object", "has_list_all_reduce", "init_process_group", "interrupt_all", "interrupt_group", "irecv", "isend", "isend_tensor",
    "ledger", "recv", "recv_object_list", "recv_tensor", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list", "send_tensor", "set_debug",
    "set_default_transport", "set_shm_kernels", "set_transport", "symmetric_empty", "symmetric_peer", "transport_of",
] + [n for n in PASSTHROUGH if hasattr(_torch_dist, n)]
