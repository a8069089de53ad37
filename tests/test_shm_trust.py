"""The shared-memory transport against other local users and against a peer that writes garbage.

In process (a transport of rank 0 of a two-rank group on a private store, rank 1's record forged
by the test): a record pointing at a symbolic link, outside /dev/shm (absolute or '../' name), at
another user's file, at a file with group/other permissions, at a file of the wrong size, at a
planted file with a wrong token, a malformed record, a FIFO that is not a FIFO: each refused with
a one-line SegmentRefusedError, the target file's bytes and mtime unchanged; a genuine segment
with the right token is accepted (the control); a FIFO name taken by someone else before this
rank creates it fails the creation, following nothing. The sweeper and the dead-peer check judge a
segment's owner by its lock, not its pid (a live owner whose pid is not visible, as from another
PID namespace, keeps its files and is not called dead). Two ranks: invalid head/tail words and
byte counts written into a ring by the peer give the same PeerCorruptError in both kernels.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
from types import SimpleNamespace

import pytest
import torch

import distrain
from distrain.comm.shm import compiled, files
from distrain.comm.shm import segment as seg_mod
from distrain.comm.shm import transport as shm
from distrain.comm.shm.segment import MAX_MESSAGE, PeerCorruptError, SegmentRefusedError
from distrain.errors import CommError, PeerLostError

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory transport needs x86-64 and /dev/shm")

NEEDS_EXT = pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))
GROUP = "trust"


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def sh(monkeypatch):
    """Rank 0's transport of a two-rank group whose store is a private HashStore (rank 1 is the test)."""
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    state = SimpleNamespace(rank=0, size=2, ranks=[0, 1], group=SimpleNamespace(group_name=GROUP), fast=None)
    t = shm.ShmTransport(state, timeout=5.0, strict=True, fallback=None)
    yield t
    t.close()


class Made(list):
    """Paths the test made (removed afterwards wherever they are) and the descriptors that hold their locks."""

    def __init__(self):
        super().__init__()
        self.fds: list[int] = []


@pytest.fixture
def made(tmp_path):
    paths = Made()
    yield paths
    for fd in paths.fds:
        os.close(fd)
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _name(pid: int | None = None, tail: str = "") -> str:
    return f"distrain-{pid or os.getpid()}-{os.urandom(4).hex()}-g{GROUP}-r1{tail}"


def _forge(sh, name: str, token: bytes = b"\x11" * 16, pid: int | None = None, size: int | None = None) -> None:
    """Write rank 1's record into the store, as another local user with access to it could."""
    pid = pid if pid is not None else os.getpid()
    sh.store.set("1", f"{name} {size or sh.layout.total} {sh.host} {pid} {token.hex()}")


def _victim(path: str, nbytes: int, made: Made, mode: int = 0o600, uid: int | None = None,
            locked: bool = True) -> tuple[bytes, int]:
    """A file of ``nbytes`` known bytes at ``path``; returns (its bytes, its mtime in ns).

    ``locked``: it appears at ``path`` already holding a shared lock, held until the test ends, as a live
    creator's file does. Other test processes create segments meanwhile, and each creation sweeps the
    pattern-named files whose lock is free (files.sweep_stale): an unlocked victim could vanish under the
    test. So it is written under a name the sweeper ignores, locked, then renamed into place."""
    data = bytes(range(256)) * (nbytes // 256) + b"\x5a" * (nbytes % 256)
    staging = os.path.join(os.path.dirname(path), f".victim-{os.urandom(6).hex()}") if locked else path
    with open(staging, "wb") as f:
        f.write(data)
    made.append(path)
    os.chmod(staging, mode)
    if uid is not None:
        os.chown(staging, uid, -1)
    if locked:
        fd = os.open(staging, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        made.fds.append(fd)
        os.rename(staging, path)
    return data, os.stat(path).st_mtime_ns


def _untouched(path: str, data: bytes, mtime: int) -> bool:
    with open(path, "rb") as f:
        return f.read() == data and os.stat(path).st_mtime_ns == mtime


def _refused(sh, match: str) -> str:
    with pytest.raises(SegmentRefusedError) as e:
        sh.seg(1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("collective on rank 0: refused rank 1's"), msg
    assert match in msg, msg
    assert 1 not in sh.peers
    return msg


# -- forged records and planted files --------------------------------------------------------------

def test_a_record_naming_a_symbolic_link_is_refused_and_its_target_untouched(sh, made, tmp_path):
    target = str(tmp_path / "victim")
    data, mtime = _victim(target, sh.layout.total, made)
    name = _name()
    os.symlink(target, os.path.join(files.SHM_DIR, name))
    made.append(os.path.join(files.SHM_DIR, name))
    _forge(sh, name)
    msg = _refused(sh, f"shared-memory segment /dev/shm/{name}: it is a symbolic link")
    assert "another user or job may be tampering" in msg
    assert _untouched(target, data, mtime)


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_record_naming_a_file_outside_dev_shm_is_refused_and_the_file_untouched(sh, made, tmp_path, where):
    target = str(tmp_path / f"distrain-{os.getpid()}-0badf00d-g{GROUP}-r1")
    data, mtime = _victim(target, sh.layout.total, made)
    name = target if where == "absolute" else os.path.relpath(target, files.SHM_DIR)
    assert ".." in name or name.startswith("/")
    _forge(sh, name)
    _refused(sh, "shared-memory record in the store (the name is not a segment name of rank 1 of this group)")
    assert _untouched(target, data, mtime)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root (os.chown)")
def test_a_file_of_another_user_is_refused_and_untouched(sh, made):
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    name = _name()
    path = os.path.join(files.SHM_DIR, name)
    data, mtime = _victim(path, sh.layout.total, made, uid=nobody)
    _forge(sh, name)
    _refused(sh, f"/dev/shm/{name}: it is owned by uid {nobody}, not by this process's uid 0")
    assert _untouched(path, data, mtime)


def test_a_file_with_group_or_other_permissions_is_refused_and_untouched(sh, made):
    name = _name()
    path = os.path.join(files.SHM_DIR, name)
    data, mtime = _victim(path, sh.layout.total, made, mode=0o644)
    _forge(sh, name)
    _refused(sh, f"/dev/shm/{name}: its mode 0644 lets group or others in (0600 expected)")
    assert _untouched(path, data, mtime)


def test_a_file_of_the_wrong_size_is_refused_and_untouched(sh, made):
    name = _name()
    path = os.path.join(files.SHM_DIR, name)
    data, mtime = _victim(path, sh.layout.total - 4096, made)
    _forge(sh, name)
    _refused(sh, f"/dev/shm/{name}: it has {sh.layout.total - 4096} bytes, this group's layout needs "
                 f"{sh.layout.total}")
    assert _untouched(path, data, mtime)


def test_a_record_claiming_another_size_is_refused(sh, made):
    name = _name()
    path = os.path.join(files.SHM_DIR, name)
    data, mtime = _victim(path, sh.layout.total + 4096, made)
    _forge(sh, name, size=sh.layout.total + 4096)
    _refused(sh, f"segment /dev/shm/{name}: its record claims {sh.layout.total + 4096} bytes, this rank's layout "
                 f"needs {sh.layout.total}; run the same distrain version on every rank")
    assert _untouched(path, data, mtime)


def test_a_planted_segment_with_a_wrong_token_is_refused_and_the_right_token_accepted(sh, made):
    """A genuine segment (our uid, 0600, the right size, its FIFO) under rank 1's name: with a
    token other than the one in its header it is refused and left as it was; with its own token
    (the control) it is mapped and marked opened."""
    name = _name()
    planted = seg_mod.create(name, sh.layout)
    try:
        path = os.path.join(files.SHM_DIR, name)
        with open(path, "rb") as f:
            data = f.read()
        mtime = os.stat(path).st_mtime_ns
        _forge(sh, name, token=bytes(16))
        _refused(sh, f"/dev/shm/{name}: its token differs from the one its rank published in the store")
        assert _untouched(path, data, mtime)
        sh.records.clear()
        _forge(sh, name, token=planted.token)
        s = sh.seg(1)
        assert s.name == name and planted.line(sh.layout.opened_line(0)) == 1
    finally:
        planted.close()


def test_a_wake_fifo_that_is_not_a_fifo_is_refused_and_untouched(sh, made):
    name = _name()
    planted = seg_mod.create(name, sh.layout)
    try:
        wake = os.path.join(files.SHM_DIR, name + ".wake")
        os.unlink(wake)
        data, mtime = _victim(wake, 100, made)
        _forge(sh, name, token=planted.token)
        _refused(sh, f"wake-up FIFO /dev/shm/{name}.wake: it is not a FIFO")
        assert _untouched(wake, data, mtime)
        assert planted.line(sh.layout.opened_line(0)) == 0  # nothing was written into the segment either
    finally:
        planted.close()


@pytest.mark.parametrize("record, why", [
    (b"x y", "2 fields, 5 expected"),
    (b"\xff\xfe", "not UTF-8"),
    (b"NAME 99999999999999999 HOST PID TOKEN", "the size is not a positive integer"),
    (b"NAME SIZE HOST 0 TOKEN", "the pid is out of range or differs from the name's"),
    (b"NAME SIZE HOST 12345 TOKEN", "the pid is out of range or differs from the name's"),
    (b"NAME SIZE HOST PID abcd", "the token is not 16 bytes of hex"),
    (b"distrain-PID-0123abcd-gtrust-r1/x SIZE HOST PID TOKEN", "the name is not a segment name of rank 1"),
    (b"distrain-PID-0123abcd-gother-r1 SIZE HOST PID TOKEN", "the name is not a segment name of rank 1"),
    (b"distrain-PID-0123abcd-gtrust-r0 SIZE HOST PID TOKEN", "the name is not a segment name of rank 1"),
])
def test_a_malformed_record_is_refused_before_any_file_is_opened(sh, record, why):
    name = f"distrain-{os.getpid()}-0123abcd-g{GROUP}-r1"
    record = (record.replace(b"NAME", name.encode()).replace(b"PID", str(os.getpid()).encode())
              .replace(b"SIZE", str(sh.layout.total).encode()).replace(b"HOST", sh.host.encode())
              .replace(b"TOKEN", b"ab" * 16))
    sh.store.set("1", record)
    _refused(sh, f"shared-memory record in the store ({why}")


def test_a_segment_that_is_gone_is_a_peer_lost_error(sh):
    _forge(sh, _name())
    with pytest.raises(PeerLostError, match=r"^collective on rank 0: rank 1's shared-memory segment /dev/shm/\S+ is "
                                            r"gone \(did that rank exit"):
        sh.seg(1)


# -- liveness by lock, not by pid ------------------------------------------------------------------

def test_the_sweeper_keeps_files_whose_owner_holds_the_lock_whatever_its_pid(made, tmp_path):
    """A live owner in another PID namespace: its pid (in the name) names no process here, but it
    holds the lock. Beside it: the same without the lock (swept), another user's file and a link
    (never touched), and FIFOs with and without their segment."""
    dead = _dead_pid()
    shm_dir = files.SHM_DIR

    def planted(tag: str, locked: bool = False, uid: int | None = None) -> str:
        path = os.path.join(shm_dir, f"distrain-{dead}-{tag}-g0-r0")
        _victim(path, 100, made, uid=uid, locked=locked)
        return path

    live = planted("11111111", locked=True)
    target = str(tmp_path / "target")
    _victim(target, 100, made)
    link = os.path.join(shm_dir, f"distrain-{dead}-33333333-g0-r0")
    os.symlink(target, link)
    made.append(link)
    fifo_alone = os.path.join(shm_dir, f"distrain-{dead}-44444444-g0-r0.wake")
    os.mkfifo(fifo_alone, 0o600)
    made.append(fifo_alone)
    fifo_kept = live + ".wake"
    os.mkfifo(fifo_kept, 0o600)
    made.append(fifo_kept)
    foreign = planted("55555555", uid=65534) if os.geteuid() == 0 else None
    stale = planted("22222222")  # (last: another process's sweep could take it first; the window is kept short)
    removed = files.sweep_stale()
    assert os.path.exists(live) and os.path.exists(fifo_kept)
    assert os.path.basename(stale) in removed and not os.path.exists(stale)
    assert os.path.basename(fifo_alone) in removed and not os.path.exists(fifo_alone)
    assert os.path.islink(link) and os.path.exists(target)
    if foreign is not None:
        assert os.path.exists(foreign)


def test_a_peer_is_dead_when_its_lock_is_free_not_when_its_pid_is_invisible(sh):
    """Rank 1's segment is made here (this process holds its lock) with a record and a name whose
    pid names no process: the waits' dead-peer check must not call it dead; once its owner closes
    it (the lock is released, as when the process dies) the check must."""
    dead = _dead_pid()
    name = _name(pid=dead)
    peer = seg_mod.create(name, sh.layout)
    try:
        _forge(sh, name, token=peer.token, pid=dead)
        s = sh.seg(1)
        sh._check_peers([1], "test wait", 0.0)  # alive: no error
        assert s.owner_alive()
    finally:
        peer.close()
    assert not s.owner_alive()
    with pytest.raises(PeerLostError, match=rf"^test wait on rank 0: rank 1 \(pid {dead}\) died while this rank "
                                            rf"waited for it \(shared-memory transport\)$"):
        sh._check_peers([1], "test wait", 0.0)


def test_created_files_are_private_and_locked(sh):
    """This rank's own segment and FIFO: mode 0600 whatever the umask, and locked (the sweeper
    cannot take the lock)."""
    old = os.umask(0)
    try:
        name = _name()
        seg = seg_mod.create(name, sh.layout)
    finally:
        os.umask(old)
    try:
        for n, kind in ((name, stat.S_ISREG), (name + ".wake", stat.S_ISFIFO)):
            st = os.stat(os.path.join(files.SHM_DIR, n), follow_symlinks=False)
            assert kind(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert name not in files.sweep_stale() and os.path.exists(os.path.join(files.SHM_DIR, name))
    finally:
        seg.close()
    assert not os.path.exists(os.path.join(files.SHM_DIR, name))


def test_a_name_taken_before_this_rank_creates_its_fifo_is_refused_and_nothing_is_left(sh, monkeypatch, made):
    """Another user who sees the segment appear may take ``<name>.wake`` first (here: a link): the
    creation fails with a CommError saying so, nothing is followed, and the segment is removed."""
    name = _name()
    make = files.make_fifo

    def raced(n: str) -> int:
        link = os.path.join(files.SHM_DIR, n)
        os.symlink("/tmp/distrain-trust-nowhere", link)
        made.append(link)
        return make(n)

    monkeypatch.setattr(files, "make_fifo", raced)
    with pytest.raises(CommError, match=rf"^shared-memory transport: cannot create /dev/shm/{name}\.wake: the name "
                                        rf"exists already \(names are random, so another local user may have "
                                        rf"created it first\); rerun, or use --transport torch$"):
        seg_mod.create(name, sh.layout)
    assert not os.path.exists(os.path.join(files.SHM_DIR, name)) and not os.path.exists("/tmp/distrain-trust-nowhere")


# -- garbage in the rings --------------------------------------------------------------------------

RING = shm.RING_BYTES
# (direction, words): "in": rank 1 breaks the ring it sends to rank 0 in (rank 0 receives); "out": rank 1
# breaks the ring rank 0 sends to it in (rank 0 sends). words: head, tail (0 when not given), or "count":
# the byte count of a message header. The last case wrote a header 8 bytes past the end of the
# segment in the unchecked C++ (the ring to rank 1 is the segment's last).
CASES = [("in", {"head": 8}), ("in", {"head": -16}), ("in", {"head": RING + 16}), ("in", {"tail": -32}),
         ("in", {"count": -5}), ("in", {"count": MAX_MESSAGE + 1}),
         ("out", {"tail": 24}), ("out", {"tail": 32}), ("out", {"tail": -(1 << 40)}), ("out", {"head": 7}),
         ("out", {"head": RING - 8, "tail": 8})]


def _garbage(rank: int, kernels: str) -> list[str]:
    """Per case a fresh group on shm; rank 1 writes garbage, rank 0 sends or receives: returns rank
    0's errors as 'Type: message'."""
    import torch.distributed as dist

    from distrain import comm
    from distrain.comm.core.group import resolve

    comm.set_shm_kernels(kernels)
    gloo = dist.new_group([0, 1])
    comm.set_transport("torch", gloo)
    out = []
    for direction, words in CASES:
        g = dist.new_group([0, 1])
        comm.set_transport("shm", g)
        comm.barrier(group=g)  # every segment mapped
        t = resolve(g, "test").transport
        if rank == 1:
            lay = t.layout
            # the ring from rank 1 to rank 0 is in rank 1's segment, the one from rank 0 to rank 1 in rank 0's
            seg, q = (t.me, 0) if direction == "in" else (t.seg(0), 1)
            if "count" in words:
                seg.ring(q)[:16].view(torch.int64).copy_(torch.tensor([0, words["count"]]))
                seg.set_line(lay.head_line(q), 16)
            for word, value in words.items():
                if word != "count":
                    seg.set_line(lay.head_line(q) if word == "head" else lay.tail_line(q), value)
        comm.barrier(group=gloo)
        if rank == 0:
            try:
                if direction == "in":
                    comm.recv(torch.empty(4), 1, group=g)
                else:
                    comm.send(torch.ones(4), 1, group=g)
                out.append("no error")
            except Exception as e:  # the type is the point
                out.append(f"{type(e).__name__}: {e}")
        comm.barrier(group=gloo)
    return out


def _expected(direction: str, words: dict) -> str:
    ring = "the ring from rank 1 to rank 0" if direction == "in" else "the ring from rank 0 to rank 1"
    if "count" in words:
        why = (f"a message header in {ring} announces {words['count']} bytes (0 to {MAX_MESSAGE}, this host's "
               f"memory, expected)")
    else:
        head, tail = words.get("head", 0), words.get("tail", 0)
        why = (f"{ring} has head {head} and tail {tail} (multiples of 16 with 0 <= tail <= head < 2^62 and head - "
               f"tail <= {RING} expected)")
    return (f"PeerCorruptError: point-to-point on rank 0: rank 1 wrote invalid words into shared memory: {why}; that "
            f"rank is treated as failed (shared-memory transport)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kernels", [pytest.param("compiled", marks=NEEDS_EXT), "python"])
def test_garbage_ring_words_from_a_peer_are_a_peer_corrupt_error_in_both_kernels(kernels):
    got = distrain.spawn(_garbage, 2, args=(kernels,), timeout=120)[0]
    assert got == [_expected(*c) for c in CASES]
    assert issubclass(PeerCorruptError, PeerLostError) and issubclass(SegmentRefusedError, CommError)
    assert not issubclass(SegmentRefusedError, PeerLostError)
