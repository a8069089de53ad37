"""Is a rank's host reachable, whatever its process is doing? A listener the kernel answers for us.

Why: a fixed job names a rank whose heartbeat has stopped (watchdog.py), but a heartbeat that stops is
not proof: a starved CPU or a GIL held in a long C call quiets a live rank for seconds. On one host the
watchdog looks the quiet process up in /proc (stopped? gone?). A process cut off from the others by its
link is alive there, so it could only be named once its node's agent ended it (8 s on the emulated
cluster). The kernel tells the two apart: it completes a TCP handshake for a listening socket without the
process running at all (SYN, SYN-ACK and the final ACK are handled in softirq, and the connection waits in
the accept queue), so a starved, GIL-bound or even SIGSTOPped rank still answers a connection, and a host
behind a cut link does not.

So each rank of a fixed job listens on its own address (the one its packets to the store leave from;
loopback for a job on one machine), accepts nothing but closes what it finds, and publishes the address
in its heartbeat. A rank that waits on a quiet peer probes the peer's address with :data:`TRIES`
connections, without blocking (:class:`Probe`): one at once and the others one every :data:`SPACING_S`,
each opened at the first poll due, all kept open until the probe is decided; it reads the outcome on
later beats:

* ``"reachable"``: one connection completed: the host and its kernel answer; the rank is slow, not cut;
* ``"refused"``: the host answered with a reset: nobody listens there any more, the process is gone;
* ``"unreachable"``: none completed within :data:`PROBE_S` of the first (or every one of the TRIES
  failed): the link or the host is down.

Spread, not at once: losses on a saturated link are not independent. A full tail-drop queue drops every
packet that arrives while it is full, so four SYNs sent together (or their SYN-ACKs coming back together)
are lost together, and a SYN's retransmission comes after PROBE_S (the kernel's first RTO is 1 s). The
16 MiB star of ``distrain bench comm`` at P = 4 on 100 Mbit/s links with 25 ms of delay (three flows into
node 0's downlink, 1300-4456 packets dropped per run) ended that way: rank 0 named live ranks "cut off".
Tries one SPACING_S apart meet the queue at different moments of its fill-and-drain cycle; with
independent 10 % loss each way one try fails with probability 0.19 and all four with 0.0013, as before.

Nothing is read from a probe connection or the listener: the peer's address comes from its heartbeat (a
value of the job's sealed store, checked by :func:`address_of` before any use) and a connection's only
information is whether it completed.
"""

from __future__ import annotations

import errno
import ipaddress
import select
import socket

PROBE_S = 1.0  # a probe whose connections have not completed by then: unreachable (>= 2 x a 200 ms spike's RTT)
TRIES = 4  # connections per probe, so a lossy link is not taken for a cut
# one try opened at once, the next ones this far apart (the last one 0.75 s in, 0.25 s before PROBE_S: > 1 RTT on
# a saturated 25 ms link, 50 ms queue), so that one burst of a full queue's drops cannot take them all
SPACING_S = PROBE_S / TRIES
BACKLOG = 512  # the accept queue: probes wait here while this rank's watchdog thread is starved (see REPROBE_S)
# A peer that answered is probed again only this often while it stays quiet: each probe leaves TRIES
# connections in the quiet rank's queue until its thread drains it, and a full queue drops SYNs as a cut does
# (3 waiting peers for a minute of starvation: 3 x 12 x 4 = 144 < BACKLOG)
REPROBE_S = 5.0


def listen(host: str | None) -> "Listener | None":
    """A :class:`Listener` on ``host``, or None (no host, or it cannot listen there: then a cut-off rank is named
    only by the time-out or once its process is gone)."""
    try:
        return Listener(host) if host is not None else None
    except OSError:
        return None


class Listener:
    """A listening TCP socket on ``host`` (a free port) that nobody is served by: :meth:`drain` accepts and
    closes whatever waits. ``address``: (host, port) to publish."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.bind((host, 0))
            self.sock.listen(BACKLOG)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.address = (host, self.sock.getsockname()[1])

    def drain(self) -> None:
        """Accept and close every connection waiting (each is a probe that has already had its answer)."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (closed, or a connection reset before it was accepted)
                return
            conn.close()

    def close(self) -> None:
        self.sock.close()


def local_address(host: str, port: int) -> str:
    """The address this host's packets to ``host:port`` leave from (a UDP socket's connect sends nothing)."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(where)
        return s.getsockname()[0]


def address_of(hb: dict | None) -> tuple[str, int] | None:
    """The probe address a heartbeat publishes (``"probe": [host, port]``), checked: a literal IP address and a
    port in 1..65535, else None (a heartbeat is a value read from the store: data, not trusted as an address)."""
    value = hb.get("probe") if isinstance(hb, dict) else None
    if not isinstance(value, list) or len(value) != 2:
        return None
    host, port = value
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, port


class Probe:
    """:data:`TRIES` non-blocking connections to ``address``: the first opened at ``now``, the others one every
    :data:`SPACING_S` (by :meth:`poll`, at its first call due); :meth:`poll` says how they ended."""

    def __init__(self, address: tuple[str, int], now: float):
        self.address, self.began = address, now
        self.family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socks: list[socket.socket] = []
        self.opened = 0  # tries opened so far
        self.failed = 0
        self.result: str | None = None
        self._open_due(now)

    def _open_due(self, now: float) -> None:
        """Open every try due by ``now`` (try i at ``began + i * SPACING_S``); a refused one decides the probe."""
        while self.result is None and self.opened < TRIES and now - self.began >= self.opened * SPACING_S:
            self.opened += 1
            s = socket.socket(self.family, socket.SOCK_STREAM)
            s.setblocking(False)
            code = s.connect_ex(self.address)
            if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self.socks.append(s)
                continue
            s.close()
            if code == errno.ECONNREFUSED:
                self._decide("refused")
                return
            self.failed += 1

    def poll(self, now: float) -> str | None:
        """"reachable", "refused" or "unreachable" once decided (then the sockets are closed), else None."""
        if self.result is not None:
            return self.result
        if self.socks:
            _, done, _ = select.select([], self.socks, [], 0)
            for s in done:
                code = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    return self._decide("reachable")
                if code == errno.ECONNREFUSED:
                    return self._decide("refused")
                self.socks.remove(s)  # (host or net unreachable, a time-out: this try failed)
                s.close()
                self.failed += 1
        if now - self.began >= PROBE_S or self.failed == TRIES:
            return self._decide("unreachable")
        self._open_due(now)  # (after the check: a try opened now has its first chance at the next poll)
        return self.result

    def _decide(self, result: str) -> str:
        self.result = result
        self.close()
        return result

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


class Prober:
    """The probes of quiet peers' hosts, at most one per rank: :meth:`verdict` opens one when a peer is first asked
    about and again every :data:`REPROBE_S` while the peer's host keeps answering; :meth:`forget` drops a peer's
    probe once it beats again (the probe belonged to an earlier silence)."""

    def __init__(self):
        self.probes: dict[int, Probe] = {}

    def verdict(self, rank: int, address: tuple[str, int], now: float) -> str | None:
        """Why ``rank``, quiet, is not coming, from its host at ``address``: cut off or gone; None while its host
        answers or the probe is undecided."""
        probe = self.probes.get(rank)
        if probe is None or (probe.result == "reachable" and now - probe.began >= REPROBE_S):
            self.forget(rank)
            probe = self.probes[rank] = Probe(address, now)
        result = probe.poll(now)
        if result == "unreachable":
            return f"cut off: its host {address[0]} answered none of {TRIES} connections in {PROBE_S:g}s"
        if result == "refused":
            return f"gone: its host {address[0]} refuses connections to its heartbeat's port"
        return None

    def forget(self, rank: int) -> None:
        probe = self.probes.pop(rank, None)
        if probe is not None:
            probe.close()

    def close(self) -> None:
        for rank in list(self.probes):
            self.forget(rank)
