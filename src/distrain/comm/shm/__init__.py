"""The shared-memory transport between the ranks of one host (as NCCL's and MPI's shm paths).

    files.py        the /dev/shm files: name pattern, safe creation and opening, owner locks, sweep
    segment.py      one rank's /dev/shm segment: control lines, slots, byte rings, wake-up pipe, record
    transport.py    ShmTransport: segments per group, adaptive waits, abort, dead-peer checks
    host.py         which host a rank is on; whether this host can use the transport
    symmetric.py    symmetric memory: buffers every rank allocates alike and every peer maps
    p2p.py          isend/irecv through per-pair byte rings (what star/ring/tree run on)
    compiled_p2p.py the same rings through the C++ extension (p2p.py's compiled path)
    collectives.py  direct collectives ("native" on this transport): read peers' slots in place
    symmetric_collectives.py  the collectives on symmetric memory, and each rank's declaration of its buffer
    hierarchy.py    all_reduce of a group over several hosts: shm inside, torch between leaders

Imports the core only. It registers itself with :mod:`distrain.comm.core.transport` on
import, and asks :mod:`distrain.comm.core.registry` for an algorithm by name (the ring between
host leaders) instead of importing one.
"""

from distrain.comm.core import transport as _core_transport
from distrain.comm.shm.segment import PeerCorruptError, SegmentRefusedError
from distrain.comm.shm.transport import ShmTransport, host_id, set_host_id, supported, unsupported

_core_transport.register_shm(unsupported, ShmTransport)

__all__ = ["PeerCorruptError", "SegmentRefusedError", "ShmTransport", "host_id", "set_host_id", "supported",
           "unsupported"]
