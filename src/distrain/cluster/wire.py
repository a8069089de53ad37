"""A delay line between two network devices: the latency (and jitter) of one emulated link.

The kernel here has no ``netem`` and no ``fq`` qdisc, so nothing in it can hold a packet for a
time; this process does. It runs in the cluster's switch namespace, one per delayed node, between
the two devices of node i's delay line (``p{i}``: the far end of the node's ``eth0``, taken off the
bridge while the node is delayed; ``v{i}``: whose veth peer ``b{i}`` is the node's bridge port
instead, see :mod:`distrain.cluster.netns`), with a raw packet socket on
each (``AF_PACKET``, every protocol, ``PACKET_VNET_HDR``: a TCP segment of up to 64 KiB that the
stack sends as one GSO packet arrives, and is sent on, as one, with its checksum-offload header,
so the rate this process must carry is the link's in bytes, not in frames). A frame read from one
device is written to the other ``delay/2 ± jitter/2`` (uniform) later: half a link's delay on the
way out of a node, half on the way in, so that two nodes with the same ``--delay D`` are D apart
one way and 2D round trip. Frames leave in the order they came (a later frame never overtakes an
earlier one, as netem with a rate), so jitter spreads them without reordering TCP's segments.
Backlog above ``--max-bytes`` is dropped, as a full queue does.

Only the standard library is used (it is started as a script: ``python wire.py ...``), and it
prints one line, ``ready``, once both sockets are bound, then nothing: the cluster reads its
settings back from its command line (``/proc/PID/cmdline``), and ``cluster down`` ends it with
the namespace's other processes.
"""

from __future__ import annotations

import argparse
import collections
import errno
import random
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4  # a frame this host sent on the device: the other side's, not ours to carry
FRAME_MAX = 65536 + 14 + 10 + 64  # a GSO packet, its Ethernet header, the virtio-net header, margin


def open_device(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
    s.bind((dev, ETH_P_ALL))
    s.setblocking(False)
    return s


class Line:
    """One direction: frames read from ``rx``, each written to ``tx`` at its due time (monotonic s).

    A send refused with ENOBUFS means the device's qdisc dropped the frame. ``tx_shaped``: ``tx``
    carries the link's shaping (p{i}: tbf, the loss filter, the cut), so that drop is the link's
    (a full queue, a lost packet, a cut node) and the frame is gone, as on the wire; otherwise
    (v{i}, no qdisc: only this host's receive backlog was full) it is sent again shortly."""

    def __init__(self, rx: socket.socket, tx: socket.socket, delay_s: float, jitter_s: float, max_bytes: int,
                 tx_shaped: bool = False):
        self.rx, self.tx, self.tx_shaped = rx, tx, tx_shaped
        self.delay, self.jitter, self.max_bytes = delay_s, jitter_s, max_bytes
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.bytes = 0
        self.last_due = 0.0

    def read(self) -> None:
        while True:
            try:
                data, addr = self.rx.recvfrom(FRAME_MAX)
            except (BlockingIOError, InterruptedError):
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            if self.bytes + len(data) > self.max_bytes:
                continue  # the queue is full: drop
            due = time.monotonic() + self.delay + (random.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
            self.last_due = max(due, self.last_due)  # never before an earlier frame
            self.queue.append((self.last_due, data))
            self.bytes += len(data)

    def send_due(self, now: float) -> float | None:
        """Send every frame due by ``now``; returns the next due time (None: nothing queued)."""
        q = self.queue
        while q and q[0][0] <= now:
            data = q[0][1]
            try:
                self.tx.send(data)
            except (BlockingIOError, InterruptedError):
                return now + 0.0005  # the device's queue is full: try again shortly
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                if not self.tx_shaped:
                    return now + 0.0005
            q.popleft()
            self.bytes -= len(data)
        return q[0][0] if q else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="delay line between two devices (one emulated link's latency)")
    p.add_argument("--node-dev", required=True, help="the device towards the node (p{i})")
    p.add_argument("--switch-dev", required=True, help="the device towards the bridge (v{i})")
    p.add_argument("--delay-us", type=int, required=True, help="the link's one-way delay, µs (half each way)")
    p.add_argument("--jitter-us", type=int, default=0, help="the link's jitter, µs (half each way, uniform ±)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="backlog per direction before dropping")
    args = p.parse_args(argv)
    a, b = open_device(args.node_dev), open_device(args.switch_dev)
    half_d, half_j = args.delay_us / 2e6, args.jitter_us / 2e6
    # towards the node the frames leave through p{i}'s qdisc (the downlink); towards the bridge through none
    lines = {a.fileno(): Line(a, b, half_d, half_j, args.max_bytes),
             b.fileno(): Line(b, a, half_d, half_j, args.max_bytes, tx_shaped=True)}
    ep = select.epoll()
    for fd in lines:
        ep.register(fd, select.EPOLLIN)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdout.close()  # the parent stops reading after one line
    while True:
        now = time.monotonic()
        dues = [d for d in (line.send_due(now) for line in lines.values()) if d is not None]
        timeout = max(0.0, min(dues) - time.monotonic()) if dues else -1
        for fd, _ in ep.poll(timeout):
            lines[fd].read()


if __name__ == "__main__":
    sys.exit(main())
