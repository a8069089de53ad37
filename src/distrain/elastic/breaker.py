"""Breaking an epoch's group at once when it lost a member: the watchdog's call on an elastic rank.

A dead peer's connections close by themselves and its shared-memory segment's lock is dropped, but one that
left the group alive, froze, or never joined it may keep them open, and a point-to-point wait is not a
bracketed call. So once the coordinator has marked the epoch as having lost a member (``lost/E``: a death, a
frozen member, or one already gone to the next epoch) and the rank is still in the epoch STUCK_S later, or has
been blocked in one call that long, :class:`Breaker` raises its shared-memory ABORT lines (comm.interrupt_all,
--transport shm: every segment of the group this rank mapped), breaks this rank's waits on torch's Works (a Gloo
message cut off mid-transfer is not woken by the sever) and then shuts the group's TCP connections down
(sockets.sever), so that what waits on the group fails now, with a PeerLostError, instead of at its time-out.
"""

from __future__ import annotations

import time

from distrain import comm
from distrain.elastic.protocol import STUCK_S, key
from distrain.elastic.sockets import sever


class Breaker:
    def __init__(self, store):
        self.store = store
        self.broke = -1  # the epoch whose group this rank broke
        self.lost_seen = (-1, 0.0)  # (epoch, when this rank saw that it lost a member)

    def check(self, epoch: int, blocked_s: float) -> None:
        """The watchdog's thread, every beat, on a rank of ``epoch`` blocked ``blocked_s`` in its current call:
        break the group if the epoch lost a member STUCK_S ago, or the call has waited that long since."""
        if self.broke == epoch:
            return
        if self.lost_seen[0] != epoch:
            if not self.store.check([key("lost", epoch)]):
                return
            self.lost_seen = (epoch, time.monotonic())
        if blocked_s >= STUCK_S or time.monotonic() - self.lost_seen[1] >= STUCK_S:
            self.broke = epoch
            # every wait on the epoch's groups ends: shm's on every rank; this rank's on torch Works too, which
            # the sever does not wake when a message was cut off mid-transfer (a link cut: GroupState.wait).
            # First, so that a wait the sever wakes (a Work whose message had not begun: "Connection closed by
            # peer") already finds the group broken and says so: sever first lost that race 1 time in a CI run
            comm.interrupt_all()
            sever(self.store.port)
