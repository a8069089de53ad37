"""The shared-memory transport: ranks of one host exchange bytes through /dev/shm.

One :class:`ShmTransport` per process group. On first use it creates this rank's segment
(segment.py), publishes ``name size host pid token`` in the process group's store under
``distrain-shm/<group name>/<group rank>``, and later opens a peer's segment by reading
that key (blocking until the peer has published it). Lazy, per peer: a point-to-point
pair never waits for ranks it does not talk to. What a peer publishes is checked before use
(segment.parse_record, files.map_peer_file: the name's pattern, no link, owner, mode, size,
token); a peer that dies is told by its segment's lock, not by its pid (files.py).

* Collectives (``algorithm="native"`` on this transport) are the direct ones of
  collectives.py: each rank copies its contribution into its slot once, publishes a step
  number in its control line, and reads or reduces straight from its peers' slots.
* Point-to-point (``isend``/``irecv``, what star/ring/tree use) goes through byte rings in
  the sender's segment (p2p.py), ordered per pair and tag.

Visibility between processes (why a reader never sees stale data): a writer stores the
data first and the step number (a single aligned 8-byte store) afterwards; a reader loads
the step number first and the data only once it sees that step. x86-64 keeps stores in
program order as seen by other cores (TSO) and never reorders two loads, and each of these
accesses is a separate call into numpy/torch that no compiler moves across. Data written
by torch's worker threads are published by the join of the parallel region, which happens
before the step store. A slot is rewritten only two steps later, and every rank waits at
each step for every peer's arrival, which a peer posts only after it finished reading the
previous step: so no slot is overwritten while a peer still reads it. Hence only x86-64 is
supported (other architectures would need explicit fences): ``auto`` falls back to torch there.

Waiting (waiting.py, the mixin :class:`~distrain.comm.shm.waiting.Waits`): spin briefly, then block
on this rank's wake-up pipe until a peer writes to it; every wait honours the timeout and notices a
peer that aborted or died.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

from distrain.comm.shm import segment as seg_mod
from distrain.comm.shm import collectives, compiled, hierarchy
from distrain.comm.shm.host import host_id, set_host_id, supported, unsupported  # noqa: F401  (this module's API)
from distrain.comm.shm.p2p import Channels
from distrain.comm.shm.symmetric import Heap
from distrain.comm.shm.waiting import Waits
from distrain.comm.shm.segment import ARRIVE, CONSUMED, SPIN_MAX_S, Layout, Segment, SegmentRefusedError
from distrain.errors import CommError

# A collective step moves at most this much per rank. 1 MiB: a rank's slot fits its L2, so
# the fold reads both slots from cache. Quiet machine, ranks bound to cores, P=2 all_reduce,
# three alternations: 9.0-9.6 GB/s busbw at 16-64 MiB against 7.5-8.6 with 4 MiB slots, the
# same at 256 KiB-4 MiB. (Earlier, on a heavily loaded machine before ranks were bound to
# cores, 1 MiB was 1.7x slower than 4 MiB: each step's synchronisation could cost a context switch.)
SLOT_BYTES = 1 << 20
RING_BYTES = 1 << 20  # per directed pair of ranks
# Slots per rank, used round robin. Two suffice for lock-step collectives; the pipelined
# all_reduce (collectives.py) keeps up to SLOTS - 1 chunks in flight, so when the peer is not
# running (more runnable threads than cores) a rank still gets SLOTS - 1 MiB done per time slice
# instead of one. More slots spread the slots over more memory than the cache keeps: P=2
# all_reduce on the 2-core machine, configurations interleaved in one run each (GB/s busbw):
#   quiet, 4 MiB:   2 slots 5.2-6.2, 4 slots 4.8-6.0, 8 slots 2.7-5.7
#   2 busy processes, 64 MiB: 2 slots 0.34-0.56, 4 slots 0.72-1.55, 8 slots 1.60-1.64
# Four keep the quiet speed and most of the gain under load.
SLOTS = 4

class ShmTransport(Waits):
    """Shared memory between the ranks of one group on this host (see the module docstring).

    ``strict``: every peer must be on this host (transport="shm"); otherwise (transport="auto")
    peers on other hosts are reached through ``fallback`` (torch's P2P).
    """

    def __init__(self, state, timeout: float, strict: bool, fallback):
        self.state = state
        self.name = "shm" if strict else "auto"
        self.strict, self.fallback, self.timeout = strict, fallback, timeout
        self.rank, self.size, self.ranks = state.rank, state.size, state.ranks
        self.me_global = self.ranks[self.rank]
        self.layout = Layout(self.size, SLOT_BYTES, RING_BYTES, SLOTS)
        self.store = dist.PrefixStore(f"distrain-shm/{state.group.group_name}/",
                                      dist.distributed_c10d._get_default_store())
        self.host = host_id()
        self.me: Segment = seg_mod.create(seg_mod.new_name(state.group.group_name, self.rank), self.layout)
        self.store.set(str(self.rank), seg_mod.record(self.me, self.host))
        self.peers: dict[int, Segment] = {self.rank: self.me}
        self.pids: dict[int, int] = {self.rank: os.getpid()}  # for messages only (liveness: the owner's lock)
        self.hosts: dict[int, str] = {self.rank: self.host}
        self.records: dict[int, seg_mod.Record] = {  # group rank -> its parsed store record
            self.rank: seg_mod.Record(self.me.name, self.layout.total, self.host, os.getpid(), self.me.token)}
        self.step = 0  # collective steps done; identical on every rank (same calls, same order)
        self.spin = SPIN_MAX_S  # seconds a wait spins before it blocks, adapted in wait()
        self.coll = "collective"  # what the current wait is for, for error messages
        self.p2p = None  # built on the first point-to-point message (p2p.Channels)
        self.heap: Heap | None = None  # symmetric allocations (symmetric.py), on the first one
        self.scratch: torch.Tensor | None = None  # a cache-sized private buffer (collectives.py)
        self._unlinked = False
        self._all_local: bool | None = None
        self._sleeping, self._sleep_lock = 0, threading.Lock()
        self._open_lock = threading.RLock()
        self._slots: dict[tuple, torch.Tensor] = {}  # (rank, buffer, dtype) -> view of a peer's slot
        # the compiled data plane (compiled.py), built on the first collective when this transport uses it
        self.kernels = compiled.kernels()
        self.plane = None
        self._atomic_sleepers = None  # count_sleepers_with
        self.fast = False  # whether the group is offered to the fast path (compiled.register)
        self.hier_plan = None  # hierarchy.py's plan of hosts and leaders, made on its first use
        self._views: dict[tuple, list[torch.Tensor]] = {}  # (buffer, dtype, count) -> every rank's slot
        if self.size == 1:
            self.unlink_when_mapped()

    # -- peers ---------------------------------------------------------------------------
    def info(self, q: int) -> tuple[str, int, str, int]:
        """(segment name, size, host, pid) of group rank q, from its store record (parsed strictly,
        seg_mod.parse_record; a bad record raises SegmentRefusedError)."""
        rec = self.records.get(q)
        if rec is None:
            try:
                self.store.wait([str(q)])
            except Exception as e:
                raise CommError(f"{self.coll} on rank {self.me_global}: rank {self.ranks[q]} never joined the "
                                f"shared-memory transport ({e})") from None
            rec = seg_mod.parse_record(self.store.get(str(q)), self.state.group.group_name, q,
                                       f"{self.coll} on rank {self.me_global}", f"rank {self.ranks[q]}")
            self.records[q] = rec
            self.hosts[q], self.pids[q] = rec.host, rec.pid
        return rec.name, rec.size, rec.host, rec.pid

    def local(self, q: int) -> bool:
        """True if group rank q is on this host (reached through shared memory)."""
        return self.info(q)[2] == self.host

    def all_local(self) -> bool:
        if self._all_local is None:
            self._all_local = all(self.local(q) for q in range(self.size))
        return self._all_local

    def direct(self, collective: str):
        """What ``algorithm="native"`` runs: the direct shared-memory collectives when the whole
        group is on this host (the compiled ones, compiled.py, or their Python reference); for a
        group over several hosts (auto) a hierarchical all_reduce, and torch's native collectives
        otherwise."""
        if self.strict or self.all_local():
            return compiled if self.kernels == "compiled" else collectives
        if collective == "all_reduce":
            return hierarchy
        return None

    def seg(self, q: int) -> Segment:
        s = self.peers.get(q)
        if s is None:
            with self._open_lock:  # the group's worker thread and the caller may both get here first
                return self._open(q)
        return s

    def _open(self, q: int) -> Segment:
        s = self.peers.get(q)
        if s is None:
            name, total, host, _ = self.info(q)
            if host != self.host:
                raise CommError(f"{self.coll} on rank {self.me_global}: transport 'shm' needs every rank on one "
                                f"host, but rank {self.ranks[q]} is on {host} and this rank on {self.host}; use "
                                f"transport 'auto' (shared memory inside a host, torch between hosts) or 'torch'")
            if total != self.layout.total:
                raise SegmentRefusedError(f"{self.coll} on rank {self.me_global}: refused rank {self.ranks[q]}'s "
                                          f"segment {seg_mod.SHM_DIR}/{name}: its record claims {total} bytes, this "
                                          f"rank's layout needs {self.layout.total}; run the same distrain version "
                                          f"on every rank")
            s = seg_mod.open_peer(name, self.layout, self.records[q].token, f"{self.coll} on rank {self.me_global}",
                                  f"rank {self.ranks[q]}")
            self.peers[q] = s
            s.set_line(self.layout.opened_line(self.rank), 1)  # the owner may unlink the file now
        return s

    def open_all(self) -> list[Segment]:
        return [self.seg(q) for q in range(self.size)]

    def open_peers(self, what: str) -> None:
        """Every peer's segment mapped (the first collective of a group opens them), errors
        meanwhile naming ``what``."""
        if len(self.peers) < self.size:
            self.coll = what
            self.open_all()

    def compiled(self):
        """The compiled data plane of this group (compiled.make_plane), built on first use."""
        if self.plane is None:
            self.coll = "collective"  # opening the peers' segments serves every collective of the plane
            self.plane = compiled.make_plane(self)
            self.count_sleepers_with(self.plane.sleepers)  # its waits count on the same line
        return self.plane

    def unlink_when_mapped(self) -> None:
        """Called after a step every rank arrived at: all peers have mapped our segment."""
        if not self._unlinked:
            self._unlinked = True
            self.me.unlink()

    def unlink_if_all_opened(self) -> None:
        """Unlink our segment's file once every peer says it opened it (cheap when already done)."""
        if self._unlinked:
            return
        lay = self.layout
        if all(self.me.line(lay.opened_line(q)) for q in range(self.size) if q != self.rank):
            self.unlink_when_mapped()

    # -- collective steps ----------------------------------------------------------------
    def begin(self) -> int:
        """A new lock-step collective step. Collectives run one after another on a rank, so
        every earlier step's reads are over: say so (CONSUMED) for a pipelined peer."""
        self.me.set_line(CONSUMED, self.step)
        self.step += 1
        return self.step

    def slot(self, q: int, step: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank q's collective buffer for ``step`` (alternating two buffers), as ``dtype``.
        Views are cached: making one costs two tensor ops, a sizeable part of a 4 KiB all_reduce."""
        k = step % self.layout.slots
        key = (q, k, dtype)
        v = self._slots.get(key)
        if v is None:
            v = self._slots[key] = self.peers[q].slot(k).view(dtype)
        return v

    def views(self, step: int, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """Every rank's slot for ``step`` as ``count`` elements of ``dtype`` (cached: small
        collectives repeat the same few sizes, and each view costs a tensor op)."""
        key = (step % self.layout.slots, dtype, count)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 256:
                self._views.clear()
            v = self._views[key] = [self.slot(q, step, dtype)[:count] for q in range(self.size)]
        return v

    def post(self, line: int, step: int, peers=None) -> None:
        self.me.set_line(line, step)
        self.wake_peers(peers)
        self.unlink_if_all_opened()

    def all_at_least(self, line: int, step: int) -> bool:
        """Whether every rank's ``line`` has reached ``step`` (no waiting)."""
        at = line * 8
        return all(s.ctrl[at] >= step for s in self.peers.values())

    def wait_all(self, line: int, step: int, what: str, peers=None) -> None:
        peer_ids = range(self.size) if peers is None else list(peers)
        at = line * 8
        ctrls = [self.peers[q].ctrl for q in peer_ids]
        self.wait(lambda: all(c[at] >= step for c in ctrls), peer_ids, what)
        if not self._unlinked and line == ARRIVE and peers is None:
            self.unlink_when_mapped()

    def symmetric_empty(self, nbytes: int) -> tuple[torch.Tensor | None, str]:
        """A collective allocation of ``nbytes`` that every peer maps (symmetric.py): this rank's
        uint8 tensor, or (None, why not) on every rank alike."""
        if not self.all_local():
            return None, "the group spans several hosts"
        if self.heap is None:
            self.heap = Heap(self)
        t, why = self.heap.empty(nbytes)
        if t is not None and self.plane is not None:
            compiled.add_symmetric(self.plane, self, self.heap.allocs[-1])
        return t, why

    def symmetric_peer(self, t: torch.Tensor, q: int) -> torch.Tensor | None:
        """Peer ``q``'s counterpart of ``t`` (uint8, its bytes; group rank q), or None when ``t`` is not in
        this group's symmetric memory."""
        found = self.heap.locate(t) if self.heap is not None else None
        if found is None or q not in found[0].views:
            return None
        alloc, offset = found
        return alloc.views[q][offset:offset + t.numel() * t.element_size()]

    # -- point-to-point ------------------------------------------------------------------
    def _channels(self):
        if self.p2p is None:
            with self._open_lock:  # one Channels per group, whichever thread sends first
                if self.p2p is None:
                    self.p2p = Channels(self)
        return self.p2p

    def isend(self, tensor: torch.Tensor, dst: int, group, tag: int):
        q = self.ranks.index(dst)
        if not self.strict and not self.local(q):
            return self.fallback.isend(tensor, dst, group, tag)
        self.seg(q)
        return self._channels().isend(tensor, q, tag)

    def irecv(self, tensor: torch.Tensor, src: int, group, tag: int):
        q = self.ranks.index(src)
        if not self.strict and not self.local(q):
            return self.fallback.irecv(tensor, src, group, tag)
        self.seg(q)
        return self._channels().irecv(tensor, q, tag)

    def unlink(self) -> None:
        """Remove this rank's files from /dev/shm and keep its mappings (GroupState.close, when a call on
        the group's worker may still read them); its symmetric allocations' files are gone already."""
        if self.me is not None:
            self._unlinked = True
            self.me.unlink()

    def close(self) -> None:
        compiled.unregister(self)
        self.plane = self._atomic_sleepers = None  # they point into the mappings closed below
        self._slots, self._views = {}, {}
        if self.heap is not None:
            self.heap.close()
            self.heap = None
        for s in list(self.peers.values()):
            s.close()
        self.peers = {}
        self.me = None
