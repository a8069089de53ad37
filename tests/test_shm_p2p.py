"""Point-to-point over the shared-memory transport, compiled (the extension's Rings) and Python
kernels: bit-exact messages of every size class (empty, one byte, not a multiple of 16, larger than
the ring) between two compiled ranks, two Python ranks and one of each (the same bytes on the ring),
proof that the compiled path ran, crossing blocking sends larger than the ring, stashed messages
and interleaved tags, two threads of a rank sharing the channels, and a peer that dies mid-message."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

import distrain
from distrain import comm
from distrain.comm.shm import compiled
from distrain.comm.shm import transport as shm
from distrain.errors import CommError

from conftest import init_raw_rank, raw_ranks, shm_files_of

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory transport needs x86-64 and /dev/shm")

NEEDS_EXT = pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))
KERNELS = [pytest.param("compiled", marks=NEEDS_EXT), "python"]
RING = shm.RING_BYTES
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int16, torch.uint8, torch.bool]
NBYTES = [0, 1, 13, 4096 + 3, RING + 1000, 3 * RING + 5]  # sizes in bytes, rounded down to the dtype


def _channels():
    from distrain.comm.core.group import resolve

    return resolve(None, "test").transport._channels()


def _payload(seed: int, nbytes: int, dtype) -> torch.Tensor:
    """Random bits (NaN payloads, odd bools and all): only a copy of every byte reproduces them."""
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8,
                         generator=g).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _ping_pong(rank: int, kernels: list[str]) -> list:
    """Rank 0 sends each message, rank 1 checks it and sends it back (blocking calls both ways,
    half of them isend().wait()); returns the mismatches and the compiled path's counts."""
    comm.set_shm_kernels(kernels[rank])
    comm.set_transport("shm")
    bad, msgs = [], 0
    for i, dtype in enumerate(DTYPES):
        for j, nb in enumerate(NBYTES):
            x = _payload(100 * i + j, nb, dtype)
            got = torch.empty_like(x)
            if rank == 0:
                (comm.isend(x, 1, tag=j).wait() if j % 2 else comm.send(x, 1, tag=j))
                comm.recv(got, 1, tag=j)
            else:
                comm.recv(got, 0, tag=j)
                (comm.send(got, 0, tag=j) if j % 2 else comm.isend(got, 0, tag=j).wait())
            msgs += 1
            if not _same_bits(got, x):
                bad.append(f"rank {rank} {dtype} {nb} bytes: differs")
    ch = _channels()
    return [bad, msgs, ch.rings is not None, ch.fast_sent, ch.fast_received]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kernels", [pytest.param(("compiled", "compiled"), marks=NEEDS_EXT), ("python", "python"),
                                     pytest.param(("compiled", "python"), marks=NEEDS_EXT)])
def test_messages_equal_bit_for_bit_and_take_the_compiled_path(kernels):
    res = distrain.spawn(_ping_pong, 2, args=(list(kernels),), timeout=150)
    for rank, (bad, msgs, has_rings, sent, received) in enumerate(res):
        assert not bad, bad
        assert has_rings == (kernels[rank] == "compiled")
        if kernels == ("compiled", "compiled"):
            # nothing else is ever pending: every message went through one C++ call per side
            assert (sent, received) == (msgs, msgs), (rank, sent, received, msgs)
        elif not has_rings:
            assert (sent, received) == (0, 0)


def _crossing(rank: int, kernels: str) -> list[bool]:
    """Every rank first sends (blocking) a message three rings long to the next rank, then receives
    from the previous one: neither send can finish before its peer reads, and neither peer reads
    before its own send finished, unless the engine stashes what arrives meanwhile.

    For P > 2 a barrier first maps every peer's segment: the engine drains only the rings of peers
    it has mapped (a pair never waits for ranks it does not talk to), and a rank sending to its
    next neighbour has not mapped its previous one's (the Python reference's limit as well)."""
    import torch.distributed as dist

    comm.set_shm_kernels(kernels)
    comm.set_transport("shm")
    P = dist.get_world_size()
    if P > 2:
        comm.barrier()
    out = []
    for it in range(3):
        n = 3 * RING // 8 + 7 + it
        mine = torch.arange(n, dtype=torch.float64) + 1000 * rank
        comm.send(mine, (rank + 1) % P, tag=it)
        got = torch.empty(n, dtype=torch.float64)
        comm.recv(got, (rank - 1) % P, tag=it)
        out.append(torch.equal(got, torch.arange(n, dtype=torch.float64) + 1000 * ((rank - 1) % P)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kernels", KERNELS)
def test_crossing_sends_larger_than_the_ring_finish(P, kernels):
    for r in distrain.spawn(_crossing, P, args=(kernels,), timeout=100):
        assert r == [True, True, True]


def _stash_and_tags(rank: int, kernels: str) -> list:
    """Messages nobody waits for yet (small and larger than the ring), received in another order
    than sent, by tag; one receive posted before its message; then a plain exchange again."""
    comm.set_shm_kernels(kernels)
    comm.set_transport("shm")
    big = torch.arange(RING // 4 * 2 + 3, dtype=torch.int32)
    if rank == 0:
        comm.send(torch.tensor([7.0]), 1, tag=4)  # rank 1 has posted an irecv for it already
        works = [comm.isend(torch.full((5,), float(i)), 1, tag=1) for i in range(3)]
        works.append(comm.isend(big, 1, tag=3))
        works.append(comm.isend(torch.tensor([42]), 1, tag=2))
        for w in works:
            w.wait()
        comm.barrier()
        comm.send(torch.tensor([1.5]), 1, tag=1)
        return []
    early = torch.empty(1)
    w4 = comm.irecv(early, 0, tag=4)
    time.sleep(0.3)  # everything rank 0 sends arrives, or waits in the ring, before a receive for it
    w4.wait()
    second = torch.empty(1, dtype=torch.int64)
    comm.recv(second, 0, tag=2)  # sent last: tags 1 and 3 go to the stash on the way
    got_big = torch.empty_like(big)
    comm.recv(got_big, 0, tag=3)
    order = []
    for _ in range(3):
        t = torch.empty(5)
        comm.recv(t, 0, tag=1)
        order.append(t[0].item())
    comm.barrier()
    before = _channels().fast_received
    last = torch.empty(1)
    comm.recv(last, 0, tag=1)  # the stash is empty again: the compiled path takes it
    return [early.item(), second.item(), torch.equal(got_big, big), order, last.item(),
            _channels().fast_received - before]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernels", KERNELS)
def test_stashed_messages_and_interleaved_tags_match(kernels):
    _, r1 = distrain.spawn(_stash_and_tags, 2, args=(kernels,), timeout=100)
    assert r1[:5] == [7.0, 42, True, [0.0, 1.0, 2.0], 1.5]
    assert r1[5] == (1 if kernels == "compiled" else 0)


def _two_threads(rank: int, kernels: str) -> list:
    """Rank 0's main thread blocks in a receive that rank 1 answers only after a message from rank
    0's second thread: the receive holds the channels, so it must hand them over to that thread."""
    comm.set_shm_kernels(kernels)
    comm.set_default_transport("shm", timeout=20)
    if rank == 0:
        def later():
            time.sleep(0.3)
            comm.send(torch.tensor([3.0]), 1, tag=2)

        t = threading.Thread(target=later)
        t.start()
        got = torch.empty(1)
        comm.recv(got, 1, tag=1)
        t.join()
        return [got.item()]
    x = torch.empty(1)
    comm.recv(x, 0, tag=2)
    comm.send(x * 2, 0, tag=1)
    return [x.item()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_blocked_receive_hands_the_channels_to_another_thread(kernels):
    assert distrain.spawn(_two_threads, 2, args=(kernels,), timeout=60) == [[6.0], [3.0]]


def _dies_mid_message(rank: int, port: int, world: int, out_dir: str, kernels: str) -> None:
    init_raw_rank(rank, port, world, kernels)
    comm.barrier()  # both segments mapped by the peer, so unlinked: a SIGKILL then leaves no file (segment.py)
    n = 3 * RING // 4
    if rank == 1:
        comm.isend(torch.ones(n), 0, tag=7)  # a third of it fits the ring: the rest never comes
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.recv(torch.empty(n), 1, tag=7)
        msg = "no error"
    except CommError as e:
        msg = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(msg)
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_peer_dying_mid_message_is_a_peer_lost_error(tmp_path, kernels):
    procs = raw_ranks(_dies_mid_message, 2, tmp_path, kernels)
    assert procs[1].exitcode == -signal.SIGKILL
    msg = (tmp_path / "rank0").read_text()
    assert msg == (f"PeerLostError: irecv on rank 0 from rank 1 (tag 7) on rank 0: rank 1 (pid {procs[1].pid}) "
                   f"died while this rank waited for it (shared-memory transport)"), msg
    assert shm_files_of(procs) == []


@NEEDS_EXT
@pytest.mark.timeout(120)
def test_bench_link_times_every_transport_side_by_side(tmp_path):
    """``distrain bench link --transport torch,shm,shm-python``: one record per transport and pair, the
    first transport's the fitted link (its times are the record's), every time positive."""
    from distrain.cli import main

    out = tmp_path / "link.json"
    assert main(["bench", "link", "--transport", "torch,shm,shm-python", "--sizes", "4K,256K,1M", "--iters", "5",
                 "--warmup", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["pair"], r["transport"]) for r in d["latency"]] == [([0, 1], t) for t in ("torch", "shm", "shm-python")]
    assert d["records"][0]["one_way_us"] == d["latency"][0]["one_way_us"]
    assert all(len(r["one_way_us"]) == 3 and min(r["one_way_us"]) > 0 for r in d["latency"])
    assert d["meta"]["transports"] == ["torch", "shm", "shm-python"]


def test_bench_link_refuses_deepspeed(capsys):
    from distrain.cli import main

    assert main(["bench", "link", "--transport", "torch,deepspeed"]) == 2
    assert capsys.readouterr().err.strip().startswith("distrain: error: --transport: unknown value(s) 'deepspeed'")
