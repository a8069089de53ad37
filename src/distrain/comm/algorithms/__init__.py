"""Our collective algorithms, each written only on :class:`~distrain.comm.core.p2p.PeerComm`.

    star.py   root-centred: P-1 messages through one rank (the parameter-server shape)
    ring.py   bandwidth-optimal ring: reduce-scatter then all-gather, 2(P-1)/P of N per rank
    tree.py   binomial tree: ceil(log2 P) rounds, for latency-bound sizes
    cost.py   exact elements each rank sends and receives, from each algorithm's closed form

Each module registers itself in :mod:`distrain.comm.core.registry` when imported; importing
this package imports all three. A fourth algorithm is one new module here and one import
line below. Algorithms import the core only (never shm/, never the API on top).
"""

# each import registers the algorithm; this order is the order of the CLI's choices
from distrain.comm.algorithms import star  # noqa: F401, I001
from distrain.comm.algorithms import ring  # noqa: F401
from distrain.comm.algorithms import tree  # noqa: F401
from distrain.comm.core import registry

ALGORITHM_NAMES: tuple[str, ...] = registry.names()
