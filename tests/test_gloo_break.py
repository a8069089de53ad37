"""A broken elastic group ends a wait whose Gloo message was cut off mid-transfer (one host, no cluster).

An elastic rank leaves the group of an epoch that lost a member by shutting its sockets down
(elastic/sockets.sever) and breaking the group (comm.interrupt_all, elastic/member.py). Gloo wakes a wait
whose message has not begun when its connection ends, but not one whose message was under way (a receive
with part of its payload read, a send with part of it written): that wait lasted until the group's
time-out, and so did the rank (link campaign trial 9: a cut link sends no RST, and rank 0 stayed 27.5 s
in its all_reduce; Gloo's own collectives are woken, its point-to-point Works, which distrain's
algorithms use, are not). Here rank 1 is stopped (SIGSTOP: its sockets stay open and silent, as behind a cut
link) by this test's process once the sender has written STOP_AT bytes of a MESSAGE-byte message to
its sockets (/proc/PID/io), so the message is certainly under way, far from done, when it stops. Rank 0,
an elastic rank (its watchdog holds an interrupt), waits on its half of the message and breaks the group
BREAK_S after the stop, as its elastic watchdog would: its wait must end with PeerLostError within
BOUND_S of the break, not at the group's time-out (TIMEOUT_S).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import free_port

TIMEOUT_S = 20  # the group's time-out: where the wait ended before
BREAK_S = 0.5  # rank 0 breaks the group this long after rank 1 stopped
BOUND_S = 3.0  # ... and its wait ends within this of the break
MESSAGE = 512 << 20  # bytes: a loaded host's loopback moves it in ~0.3-1 s, far past a socket's buffers
STOP_AT = 16 << 20  # rank 1 stops once the sender has written this many bytes of it


def _written(pid: int) -> int:
    """Bytes ``pid`` has passed to write calls (Gloo's writes to its sockets included: /proc/PID/io)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("wchar:"))


def _rank(r: int, port: int, how: str, op: str, out, stopped) -> None:
    from distrain import comm
    from distrain.comm.core import watchdog
    from distrain.elastic.sockets import sever
    from distrain.errors import PeerLostError

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=r == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=r, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    buf = torch.ones(MESSAGE // 4)
    if r == 1:  # the peer: says "go" just before its half of the message, which the test stops part-way
        comm.barrier(algorithm="native")
        out.send("go")
        if op == "ring all_reduce":
            comm.all_reduce(buf, algorithm="ring")
        elif how == "send":  # rank 0 sends
            comm.recv(buf, 0)
        else:
            comm.send(buf, 0)
        out.send("the message completed")  # (never, once stopped)
        time.sleep(60)
        return
    # rank 0: an elastic rank's watchdog (it has an interrupt), as elastic/member.py installs it
    watchdog.install(dist.PrefixStore("wd", store), 0, 2, 2 * TIMEOUT_S + 30, interval=1.0, interrupt=lambda s: None)

    def brk():
        stopped.wait(60)
        time.sleep(BREAK_S)
        broke_at.append(time.monotonic())
        comm.interrupt_all()  # (in elastic/breaker.py's order: the group marked broken before its sockets close)
        sever(port)

    broke_at: list = []
    threading.Thread(target=brk, daemon=True).start()
    comm.barrier(algorithm="native")
    try:
        if op == "ring all_reduce":
            comm.all_reduce(buf, algorithm="ring")
        elif how == "send":
            comm.send(buf, 1)
        else:
            comm.recv(buf, 1)
        what = "completed"
    except PeerLostError as e:
        what = f"PeerLostError: {e}"
    except Exception as e:  # noqa: BLE001 - reported: the test names it
        what = f"{type(e).__name__}: {e}"
    end = time.monotonic()
    out.send((what, end - broke_at[0] if broke_at else None))
    os._exit(0)


def run(how: str, op: str) -> tuple[str, float | None, int]:
    """Rank 0 receives (how="recv") or sends (how="send") MESSAGE bytes (op="p2p"), or all-reduces them
    with rank 1 (op="ring all_reduce": distrain's ring, an elastic DDP's default, whose pieces are
    point-to-point messages); rank 1 is stopped part-way. Returns how rank 0's wait ended, how long after
    the break, and how many bytes the sender had written when rank 1 stopped."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    stopped = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, how, op, pipes[r][1], stopped), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert pipes[1][0].poll(60), "rank 1 never reached its message"
        assert pipes[1][0].recv() == "go"
        sender = procs[0 if how == "send" else 1].pid
        base = _written(sender)
        deadline = time.monotonic() + 30
        while (moved := _written(sender) - base) < STOP_AT:
            assert time.monotonic() < deadline, f"the sender wrote {moved} bytes in 30s"
            time.sleep(0.001)
        os.kill(procs[1].pid, signal.SIGSTOP)
        moved = _written(sender) - base
        stopped.set()
        assert pipes[0][0].poll(TIMEOUT_S + 60), "rank 0 said nothing"
        what, waited = pipes[0][0].recv()
        assert not pipes[1][0].poll(0), "rank 1's message completed: it was not stopped part-way"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    return what, waited, moved


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,op", [("recv", "p2p"), ("send", "p2p"), ("recv", "ring all_reduce")])
def test_broken_group_ends_a_wait_cut_off_mid_message(how, op):
    what, waited, moved = run(how, op)
    assert STOP_AT <= moved < MESSAGE, f"the sender wrote {moved} of {MESSAGE} bytes"
    assert what.startswith("PeerLostError: ") and "the group was broken" in what, f"{what} ({waited}s after the break)"
    assert waited < BOUND_S, f"the wait ended {waited:.1f}s after the break (the group's time-out is {TIMEOUT_S}s)"


class _Work:
    """A stand-in for a torch point-to-point Work: wait() blocks until ``end`` is set, then raises ``error``."""

    def __init__(self, error: BaseException | None = None, ended: bool = False):
        self.end, self.error, self.threads = threading.Event(), error, []
        if ended:
            self.end.set()

    def wait(self) -> bool:
        self.threads.append(threading.current_thread())
        self.end.wait(30)
        if self.error is not None:
            raise self.error
        return True


def _state():
    from distrain.comm.core.group import GroupState

    st = GroupState.__new__(GroupState)  # (no process group: GroupState.wait needs none)
    st.broken, st.waits = False, set()
    return st


@pytest.mark.timeout(30)
def test_a_breakable_wait_hands_its_works_to_one_reused_thread_and_passes_their_error_on():
    st, err = _state(), RuntimeError("Connection closed by peer")
    a, b, c = _Work(ended=True), _Work(ended=True), _Work(err, ended=True)
    st.wait([a, b], "all_reduce")
    with pytest.raises(RuntimeError) as got:
        st.wait([c], "all_reduce")
    assert got.value is err
    assert a.threads[0] is b.threads[0] is c.threads[0] is not threading.current_thread()
    assert a.threads[0].name == "distrain-wait" and st.waits == set()


@pytest.mark.timeout(30)
def test_the_break_ends_a_wait_under_way_with_peer_lost_and_leaves_its_thread_to_finish():
    from distrain.errors import PeerLostError

    st, stuck = _state(), _Work()
    broke: list[float] = []

    def breaker():  # the break once the waiter is inside the stuck wait (a loaded host may start it late)
        deadline = time.monotonic() + 20
        while not stuck.threads and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        broke.append(time.monotonic())
        st.break_waits()

    threading.Thread(target=breaker, daemon=True).start()
    with pytest.raises(PeerLostError, match=r"^recv from 1: the group was broken while this call waited"):
        st.wait([stuck], "recv from 1")
    assert broke and time.monotonic() - broke[0] < 2.0
    waiter = stuck.threads[0]
    assert waiter.is_alive()  # still in the stuck work's wait (Gloo's, until the group's time-out)
    fresh = _Work(ended=True)
    with pytest.raises(PeerLostError, match=r"^send to 1: the group was broken \(a member was lost"):
        st.wait([fresh], "send to 1")  # a broken group takes no new wait
    assert fresh.threads == []
    stuck.end.set()
    waiter.join(5)
    assert not waiter.is_alive()  # the left thread ends with its wait; it is never handed another


if __name__ == "__main__":  # python tests/test_gloo_break.py recv|send p2p|"ring all_reduce": one run, printed
    import sys

    print(run(sys.argv[1], sys.argv[2]))
