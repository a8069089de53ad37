"""Elastic training: a job that loses and gains ranks without restarting the others.

``distrain train --elastic MIN:MAX --nproc N --strategy ddp|zero1|zero2|zero3|ps-sync [--elastic-replace K]``:

    spec.py         the flag: MIN:MAX and the rules a job must meet (refused before any rank starts)
    coordinator.py  the top process: hosts the store, decides every new membership (who is in, the
                    step to go on from), starts replacements, stops below MIN; its processes are
                    the launcher's (distrain.launch.supervisor), as every job's
    beats.py        the coordinator's watch on its members' heartbeats (frozen members, what late ones do)
    nodes.py        several nodes: node agents (on the same supervisor) report their ranks to node 0
    ranks.py        how a rank process is started (environment, the Member it installs first)
    member.py       one rank: a process group per membership epoch, the per-step quorum ("is the group
                    still whole?"), roll-back to the start of a step cut in half, healing a newcomer
    copies.py       a ZeRO rank's copies: its piece at each step's start and the previous rank's (the
                    replica), in place over symmetric memory or as a message
    pieces.py       state trees: packing, the replica's message (Exchange) and its in-place buffers (InPlace)
    breaker.py      when a rank breaks its epoch's group (it lost a member): the watchdog's call
    sockets.py      leaving a broken Gloo group at once (its TCP connections shut down; the shm
                    transport's waits end through comm.interrupt_group)
    protocol.py     the store's keys, a rank's environment, the test hooks' points, the change record
                    and the checks of the coordinator's membership records
    faults.py       fault injection for tests (DISTRAIN_ELASTIC_FAULTS), read in one place

The trainer's one loop (trainer/loop.py) calls an ElasticGuard (trainer/guard.py) at the start and
end of each step; on a change it builds a new engine on the new group and loads the state the
Member hands it, so engines never see a dead rank. A lost peer is a PeerLostError (the comm
layer's type), never a matched message. docs/fault_tolerance.md ("Elastic training") has the
design, the numbers and what is left out.
"""

from distrain.elastic.spec import SUPPORTED, check, check_nodes, parse

__all__ = ["SUPPORTED", "check", "check_nodes", "parse"]
