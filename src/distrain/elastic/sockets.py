"""Leaving a broken Gloo group at once: shut down its TCP connections (Linux /proc)."""

from __future__ import annotations

import os
import socket


def sever(keep_port: int) -> int:
    """Shut down every TCP socket of this process but the store's (port ``keep_port``): Gloo's
    connections of a broken group. Gloo has no abort; a peer blocked in a receive from a rank that
    left would wait for the group's time-out, and destroying the group would wait for our own
    worker threads blocked the same way. A shut-down socket wakes both ends at once (the peer reads
    "connection closed" and leaves too), so a loss spreads through the group in milliseconds.
    Returns how many sockets were shut down. (Linux: /proc/self/fd and /proc/net/tcp{,6}.)"""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "01":  # established connections only: Gloo's listener aborts the process if shut down
                continue
            ports[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        pair = ports.get(link[8:-1]) if link.startswith("socket:[") else None
        if pair is None or keep_port in pair:
            continue
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only; Gloo closes its own descriptor with the group
    return n
