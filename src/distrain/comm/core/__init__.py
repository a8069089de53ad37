"""The core of distrain.comm: what every algorithm and transport stands on.

    util.py       dtype codes, byte counts, int checks, chunking
    tags.py       the one map of P2P tag ranges (user, parameter server, pipeline, collectives)
    ops.py        reduce ops and dtype rules
    transport.py  the Transport interface, torch's P2P as the built-in one, the per-group choice
    group.py      per-group rank maps, sequence numbers (= tags), transport, async worker
    torchargs.py  torch's calling rules: non-member no-op, group_src/group_dst
    p2p.py        send/recv/isend/irecv (+ header variants) and PeerComm for algorithms
    ledger.py     traffic accounting
    watchdog.py   a collective that waits too long is reported with who is missing
    failures.py   a backend or transport failure under a call is PeerLostError (by type, not text)
    registry.py   the algorithm interface (Protocol) and the registry algorithms add themselves to

Imports nothing else of distrain.comm (tests/test_import_graph.py keeps it so).
"""
