"""distrain.comm: point-to-point messages and the collectives, native or our own.

``import distrain.comm as dist`` serves as ``torch.distributed``: every collective and P2P
function has torch's signature (plus ``algorithm=``), and the process-group functions are
torch's own or thin wrappers (compat.py); any other name falls through to torch.distributed.

Layers, each depending only on those above it:

    util.py        shared helpers: dtype codes, byte counts, int checks
    tags.py        the one map of P2P tag ranges (user, parameter server, pipeline, collectives)
    transports.py  the one place bytes leave the process; chosen per group, injectable
    group.py       per-group rank maps, sequence numbers (= tags), transport, async worker
    torchargs.py   torch's calling rules: non-member no-op, group_src/group_dst
    p2p.py         send/recv/isend/irecv (+ header variants) and PeerComm for algorithms
    ops.py         reduce ops and dtype rules
    ledger.py      traffic accounting
    star.py ring.py tree.py   our algorithms, written only on PeerComm
    shm_segment.py shm.py shm_p2p.py   the shared-memory transport (segments, waits, P2P rings)
    shm_coll.py    direct shared-memory collectives ("native" on the shm transport)
    hierarchy.py   all_reduce over several hosts: shm inside, torch between leaders
    registry.py    the algorithm registry and its interface (Protocol)
    cost.py        exact traffic per rank, from each algorithm's own closed form
    dispatch.py    argument checks, the debug fingerprint, the dispatcher (ledger, ours, direct or native), async handles
    api.py         the eight collectives with torch.distributed's signatures, on dispatch.py
    forms.py       *_into_tensor / *_tensor / coalesced forms, P2POp, batch_isend_irecv
    alltoall.py    all_to_all, all_to_all_single
    objects.py     the object collectives (pickled)
    compat.py      init/destroy_process_group and the pass-through group helpers
"""

import torch.distributed as _torch_dist

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
    set_transport,
    transport_of,
)
from distrain.comm.compat import PASSTHROUGH, destroy_process_group, init_process_group
from distrain.comm.forms import (
    P2POp,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce_coalesced,
    batch_isend_irecv,
    reduce_scatter_tensor,
)
from distrain.comm.group import close_all, close_group
from distrain.comm.ledger import Counts, Ledger, ledger
from distrain.comm.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from distrain.comm.transports import TRANSPORT_NAMES, Transport, set_default_transport
from distrain.comm.p2p import irecv, isend, isend_tensor, recv, recv_tensor, send, send_tensor

globals().update({_n: getattr(_torch_dist, _n) for _n in PASSTHROUGH if hasattr(_torch_dist, _n)})


def __getattr__(name: str):
    """Anything else torch.distributed has (e.g. DeviceMesh helpers) is torch's own."""
    try:
        return getattr(_torch_dist, name)
    except AttributeError:
        raise AttributeError(f"module 'distrain.comm' has no attribute {name!r} (nor has torch.distributed)") from None


__all__ = [
    "ALGORITHM_NAMES", "COLLECTIVES", "CommHandle", "Counts", "Ledger", "P2POp", "TRANSPORT_NAMES", "Transport",
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_reduce_list", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "close_all", "close_group", "debug_enabled", "destroy_process_group",
    "gather", "gather_object", "has_list_all_reduce", "init_process_group", "irecv", "isend", "isend_tensor",
    "ledger", "recv", "recv_object_list", "recv_tensor", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list", "send_tensor", "set_debug",
    "set_default_transport", "set_transport", "transport_of",
] + [n for n in PASSTHROUGH if hasattr(_torch_dist, n)]
