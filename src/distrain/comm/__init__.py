"""distrain.comm: point-to-point messages and the eight collectives, native or our own.

Layers, each depending only on those above it:

    transport.py   the one place bytes leave the process (torch.distributed P2P)
    group.py       per-group rank maps, sequence numbers (= tags), async worker
    p2p.py         send/recv/isend/irecv (+ header variants) and PeerComm for algorithms
    ops.py         reduce ops and dtype rules
    ledger.py      traffic accounting
    star.py ring.py tree.py   our algorithms, written only on PeerComm
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
)
from distrain.comm.ledger import Counts, Ledger, ledger
from distrain.comm.p2p import irecv, isend, isend_tensor, recv, recv_tensor, send, send_tensor

__all__ = [
    "ALGORITHM_NAMES", "COLLECTIVES", "CommHandle", "Counts", "Ledger",
    "all_gather", "all_reduce", "barrier", "broadcast", "debug_enabled", "gather", "irecv", "isend",
    "isend_tensor", "ledger", "recv", "recv_tensor", "reduce", "reduce_scatter", "scatter", "send", "send_tensor",
    "set_debug",
]
