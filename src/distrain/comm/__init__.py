"""distrain.comm: point-to-point messages and the eight collectives, native or our own.

Layers, each depending only on those above it:

    util.py        shared helpers: dtype codes, byte counts, int checks
    tags.py        the one map of P2P tag ranges (user, parameter server, pipeline, collectives)
    transports.py  the one place bytes leave the process; chosen per group, injectable
    group.py       per-group rank maps, sequence numbers (= tags), transport, async worker
    p2p.py         send/recv/isend/irecv (+ header variants) and PeerComm for algorithms
    ops.py         reduce ops and dtype rules
    ledger.py      traffic accounting
    star.py ring.py tree.py   our algorithms, written only on PeerComm
    shm_segment.py shm.py shm_p2p.py   the shared-memory transport (segments, waits, P2P rings)
    shm_coll.py    direct shared-memory collectives ("native" on the shm transport)
    hierarchy.py   all_reduce over several hosts: shm inside, torch between leaders
    registry.py    the algorithm registry and its interface (Protocol)
    cost.py        exact traffic per rank, from each algorithm's own closed form
    api.py         the public collectives: validation, dispatch, async handles, debug checks
"""

from distrain.comm.api import (
    ALGORITHM_NAMES,
    COLLECTIVES,
    CommHandle,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    debug_enabled,
    gather,
    reduce,
    reduce_scatter,
    scatter,
    set_debug,
    set_transport,
    transport_of,
)
from distrain.comm.group import close_all, close_group
from distrain.comm.ledger import Counts, Ledger, ledger
from distrain.comm.transports import TRANSPORT_NAMES, Transport, set_default_transport
from distrain.comm.p2p import irecv, isend, isend_tensor, recv, recv_tensor, send, send_tensor

__all__ = [
    "ALGORITHM_NAMES", "COLLECTIVES", "CommHandle", "Counts", "Ledger",
    "all_gather", "all_reduce", "barrier", "broadcast", "debug_enabled", "gather", "irecv", "isend",
    "isend_tensor", "ledger", "recv", "recv_tensor", "reduce", "reduce_scatter", "scatter", "send", "send_tensor",
    "close_all", "close_group", "set_debug", "set_default_transport", "set_transport", "transport_of", "Transport", "TRANSPORT_NAMES",
]
