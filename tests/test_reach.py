"""The reachability probe (comm/core/reach.py) and the watchdog naming a cut-off rank from it.

A probe tells a host that answers (whatever its process is doing: starved, GIL-bound, even SIGSTOPped: the
kernel completes the handshake) from one that does not (a cut link: emulated here by a listener whose accept
queue is full, where Linux drops every new SYN just as a cut link does) and from a port nobody listens on
(a reset: the process is gone). The cut link itself is tests/test_heartbeat.py's cluster test.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from distrain.comm.core import process, reach, watchdog


def _settle(probe: reach.Probe, limit: float = 5.0) -> tuple[str, float]:
    began = time.monotonic()
    while (result := probe.poll(time.monotonic())) is None and time.monotonic() - began < limit:
        time.sleep(0.01)
    return result, time.monotonic() - began


def _blackhole() -> tuple[socket.socket, list[socket.socket], tuple[str, int]]:
    """A port that takes no new connection and sends nothing back: listen(0) with its queue filled."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    fill = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(s.getsockname())
        fill.append(c)
    time.sleep(0.1)
    return s, fill, s.getsockname()


@pytest.mark.timeout(30)
def test_a_stopped_process_still_answers_a_closed_port_refuses_and_a_silent_one_is_unreachable_in_probe_s():
    # the child loads reach.py alone (it imports the standard library only), not the distrain package and torch
    child = subprocess.Popen([sys.executable, "-c", (
        "import importlib.util, os, signal, sys; spec = importlib.util.spec_from_file_location('reach', sys.argv[1]); "
        "reach = sys.modules['reach'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(reach); "
        "l = reach.Listener('127.0.0.1'); print(l.address[1], flush=True); os.kill(os.getpid(), signal.SIGSTOP)"),
        reach.__file__], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while process.state({"pid": child.pid, "start": _start(child.pid), **_ns()}, process.identity()) \
                != "stopped" and time.monotonic() < deadline:
            time.sleep(0.02)
        # every TRIES connection completes with the process stopped (4 < BACKLOG, nobody accepts)
        assert _settle(reach.Probe(("127.0.0.1", port), time.monotonic()))[0] == "reachable"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # its process is gone: the port is closed, the kernel resets
    assert _settle(reach.Probe(("127.0.0.1", port), time.monotonic()))[0] == "refused"
    s, fill, address = _blackhole()
    try:
        result, took = _settle(reach.Probe(address, time.monotonic()))
    finally:
        for c in [s, *fill]:
            c.close()
    assert result == "unreachable" and reach.PROBE_S <= took < reach.PROBE_S + 1.0, (result, took)


@pytest.mark.timeout(30)
def test_tries_are_spread_so_one_burst_of_drops_does_not_take_them_all():
    """A saturated tail-drop queue drops every packet while it is full: SYNs sent together are lost together, and
    their retransmission (1 s) comes after PROBE_S. Emulated: a listener whose full queue drops the first try's
    SYN (a burst), then drained (the burst ends) before the second try is due: the second completes, the host is
    reachable. (With the four tries opened at once, all four SYNs fell in the burst: "unreachable" at PROBE_S.)
    The clock handed to the probe is its own, so the outcome does not depend on this host's scheduling: the real
    time this takes (< 0.5 s) is well before the first try's SYN is sent again."""
    s, fill, address = _blackhole()
    try:
        t0 = time.monotonic()
        probe = reach.Probe(address, t0)
        time.sleep(0.05)
        assert probe.poll(t0 + 0.05) is None and probe.opened == 1  # its SYN dropped: the queue is full
        for c in fill:  # the burst ends: the queue drains
            c.close()
        s.setblocking(False)
        conn, _ = s.accept()
        conn.close()
        assert probe.poll(t0 + reach.SPACING_S) is None and probe.opened == 2
        time.sleep(0.05)
        assert probe.poll(t0 + reach.PROBE_S) == "reachable"
    finally:
        for c in [s, *fill]:
            c.close()
    # a host that answers none: every try is opened, one SPACING_S apart, and the probe ends at PROBE_S
    s, fill, address = _blackhole()
    try:
        t0 = time.monotonic()
        probe = reach.Probe(address, t0)
        for i in range(1, reach.TRIES):
            assert probe.poll(t0 + i * reach.SPACING_S - 0.01) is None and probe.opened == i
            assert probe.poll(t0 + i * reach.SPACING_S) is None and probe.opened == i + 1
        assert probe.poll(t0 + reach.PROBE_S - 0.01) is None
        assert probe.poll(t0 + reach.PROBE_S) == "unreachable" and probe.socks == []
    finally:
        for c in [s, *fill]:
            c.close()


def _start(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _ns() -> dict:
    ident = process.identity()
    return {"boot": ident["boot"], "pidns": ident["pidns"]}


def test_a_listener_drains_its_queue_and_a_heartbeat_address_is_checked_before_use():
    listener = reach.Listener("127.0.0.1")
    try:
        assert _settle(reach.Probe(listener.address, time.monotonic()))[0] == "reachable"
        time.sleep(0.05)
        listener.drain()
        with pytest.raises(BlockingIOError):
            listener.sock.accept()  # (nothing left waiting)
    finally:
        listener.close()
    assert reach.address_of({"probe": ["10.0.0.2", 4000]}) == ("10.0.0.2", 4000)
    assert reach.address_of({"probe": ["::1", 1]}) == ("::1", 1)
    for forged in (None, {}, {"probe": "10.0.0.2:4000"}, {"probe": ["10.0.0.2"]}, {"probe": ["localhost", 4000]},
                   {"probe": ["10.0.0.2", 0]}, {"probe": ["10.0.0.2", 65536]}, {"probe": ["10.0.0.2", True]},
                   {"probe": ["10.0.0.2", "4000"]}, {"probe": ["/tmp/x", 4000]}, {"probe": [4000, "10.0.0.2"]}):
        assert reach.address_of(forged) is None, forged


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the SystemExit below)
@pytest.mark.timeout(30)
def test_a_quiet_live_rank_is_named_only_when_its_host_does_not_answer():
    """Three quiet ranks whose processes are alive (this process's identity): rank 1's host answers (a real
    listener), rank 2's sends nothing back (a blackhole), rank 3's probe address is forged (a host name).
    Rank 0, blocked in a call, names rank 2 as cut off once its probe has gone unanswered for PROBE_S, and
    names neither rank 1 (alive and reachable: a starved rank) nor rank 3 (nothing to probe)."""
    store = dist.HashStore()
    reports: list[str] = []

    def report(text: str) -> None:
        reports.append(text)
        raise SystemExit  # ends the watchdog's thread before it ends this process (os._exit)

    live = reach.Listener("127.0.0.1")
    s, fill, hole = _blackhole()
    me = process.identity()
    records = {1: list(live.address), 2: list(hole), 3: ["localhost", live.address[1]]}
    for r, probe in records.items():
        store.set(f"j/wd/{r}", json.dumps({"n": 1, "calls": 3, "op": None, "blocked_s": 0, "t": 0, **me,
                                           "probe": probe}))
    wd = watchdog.Watchdog(store, 0, 4, 30.0, report, interval=0.05, quiet_s=0.25, connect=lambda: store,
                           prefix="j/").start()
    try:
        began = time.monotonic()
        wd.enter("all_reduce(algorithm=ring) on rank 0", 4)
        while not reports and time.monotonic() - began < 10:
            time.sleep(0.02)
    finally:
        wd.stop()
        for c in [live, s, *fill]:
            c.close()
    assert len(reports) == 1, reports
    m = re.fullmatch(r"rank\(s\) not responding: rank 0 waited (\d\.\d\d)s in all_reduce\(algorithm=ring\) on rank 0 "
                     r"\(seq 4 in its group, its call #1\); 3 rank\(s\) did not arrive: rank 2 not responding \(no "
                     r"heartbeat for (\d\.\d)s: cut off: its host 127\.0\.0\.1 answered none of 4 connections in 1s\); "
                     r"rank 1 busy outside communication after 3 calls \(a slow step, a loop, or it skipped this "
                     r"collective\); rank 3 busy outside communication after 3 calls \(a slow step, a loop, or it "
                     r"skipped this collective\)\. Named from the heartbeats \(every 0\.05s\), before "
                     r"--collective-timeout \(now 30s\)", reports[0])
    assert m, reports[0]
    assert float(m.group(1)) >= reach.PROBE_S  # (the probe needs PROBE_S; quiet_s here is 0.25)
