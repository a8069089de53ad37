"""Symmetric memory: buffers that every rank of a shared-memory group allocates alike and
every peer maps, so a collective works on them in place (no copy into slots and back).

The idea of torch's ``torch.distributed._symmetric_memory`` and of NCCL's registered
buffers (``ncclMemAlloc`` + window registration), on /dev/shm. Allocation is collective:
every rank of the group calls :meth:`Heap.empty` in the same order with the same size, so
allocation k has the same index and size on every rank, and a tensor at byte offset o of
allocation k on one rank has its counterpart at offset o of allocation k on each peer.

One allocation = one file ``/dev/shm/<segment name>-s<k>`` per rank, created and reserved
(fallocate: a full /dev/shm fails here, not with SIGBUS later) with a page after the data that
holds a random token, published in the group's store (``<name> <size> <token>``), mapped by every
peer after files.map_peer_file's checks, and unlinked by its owner once every peer has said it
mapped it (the mappings live on; the kernel frees the memory with the last one). If any rank cannot
allocate, every rank gets None and the reason (the caller falls back to ordinary memory on
every rank alike: a symmetric buffer on some ranks only would make the ranks take different
paths in the collectives).

Lifetime: an allocation lives as long as its transport (the group); there is no free.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass, field

import torch

from distrain.comm.shm import files
from distrain.errors import CommError

ALIGN = 4096  # every allocation starts on a page
OFFSET_BITS = 40  # an allocation's code: (index + 1) << OFFSET_BITS | byte offset (Allocation.code)
MAX_RECORD = 1024  # bytes of a peer's record read at most


@dataclass
class Allocation:
    index: int
    nbytes: int
    base: int  # this rank's data_ptr of the allocation
    views: dict[int, torch.Tensor] = field(default_factory=dict)  # group rank -> uint8 view of its file
    maps: list[mmap.mmap] = field(default_factory=list)

    def code(self, offset: int) -> int:
        """A nonzero number naming (allocation, byte offset), the same on every rank for counterparts."""
        return (self.index + 1) << OFFSET_BITS | offset


class Heap:
    """The symmetric allocations of one shared-memory transport (one group)."""

    def __init__(self, sh):
        self.sh = sh
        self.allocs: list[Allocation] = []
        self.failed = 0  # collective allocations that fell back (counted alike on every rank)

    def _key(self, k: int, q: int, what: str = "") -> str:
        return f"sym{k}/{q}{what}"

    def empty(self, nbytes: int) -> tuple[torch.Tensor | None, str]:
        """Allocate ``nbytes`` on every rank (call on every rank, same order, same size).

        Returns (this rank's uint8 tensor of the allocation, "") or (None, why not) on every rank.
        A peer's allocation is mapped only after the checks of files.map_peer_file (its name is that
        peer's segment name and ``-s<k>``, its record's size is this rank's, its file is its own with
        the token its record carries); a failed check raises SegmentRefusedError.
        """
        sh = self.sh
        k = len(self.allocs) + self.failed
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        name = f"{sh.me.name}-s{k}"
        lock = mm = None
        why = ""
        try:
            lock, mm = files.create_file(name, size + ALIGN)  # the data, then a page holding the token
        except (CommError, OSError) as e:
            why = f"rank {sh.me_global}: {e}"
        token = secrets.token_bytes(files.TOKEN_BYTES)
        if mm is not None:
            mm[size:size + files.TOKEN_BYTES] = token
        sh.store.set(self._key(k, sh.rank), f"! {why}" if mm is None else f"{name} {size} {token.hex()}")
        maps = [] if mm is None else [mm]
        try:
            others = {q: self._record(q, k) for q in range(sh.size) if q != sh.rank}
            bad = next((v for v in others.values() if isinstance(v, str)), None)
            if mm is None or bad is not None:
                self.failed += 1
                if mm is not None:
                    mm.close()
                return None, why or bad
            mine = torch.frombuffer(mm, dtype=torch.uint8, count=size)
            alloc = Allocation(k, size, mine.data_ptr(), {sh.rank: mine}, maps)
            where = f"symmetric memory on rank {sh.me_global}"
            for q, (peer_name, peer_size, peer_token) in others.items():
                if peer_size != size:
                    raise CommError(f"{where}: rank {sh.ranks[q]} allocated {peer_size} bytes as allocation {k}, this "
                                    f"rank {size}; every rank must allocate the same sizes in the same order")
                fd, pm = files.map_peer_file(peer_name, size + ALIGN, peer_token, size, where, f"rank {sh.ranks[q]}",
                                             f"symmetric allocation {k}")
                os.close(fd)
                maps.append(pm)
                alloc.views[q] = torch.frombuffer(pm, dtype=torch.uint8, count=size)
            # every peer mapped this rank's file: unlink it (the mappings stay; no sweeper may take it now)
            sh.store.set(self._key(k, sh.rank, "/mapped"), "1")
            sh.store.wait([self._key(k, q, "/mapped") for q in range(sh.size)])
        except BaseException:
            for m in maps:
                try:
                    m.close()
                except BufferError:
                    pass
            raise
        finally:
            if lock is not None:
                files.unlink_file(name)
                lock.release()
        self.allocs.append(alloc)
        return mine[:nbytes], ""

    _RECORD = re.compile(rf"(\S+) ([1-9][0-9]{{0,15}}) ([0-9a-f]{{{2 * files.TOKEN_BYTES}}})")

    def _record(self, q: int, k: int) -> tuple[str, int, bytes] | str:
        """Peer q's record of allocation k, parsed strictly: (name, size, token), or the reason it
        could not allocate (a one-line string). The name must be q's segment name and ``-s<k>``."""
        sh = self.sh
        key = self._key(k, q)
        sh.store.wait([key])
        raw = sh.store.get(key)[:MAX_RECORD]
        text = raw.decode("utf-8", "replace")
        if text.startswith("! "):
            return " ".join(text[2:].split())  # one line, whatever it carried
        m = self._RECORD.fullmatch(text)
        expected = f"{sh.info(q)[0]}-s{k}"
        if m is None or m.group(1) != expected:
            raise files.SegmentRefusedError(
                f"symmetric memory on rank {sh.me_global}: refused rank {sh.ranks[q]}'s record of allocation {k} in "
                f"the store ({text[:120]!r}; '{expected} <size> <token>' expected); another user or job may be "
                f"tampering with the store")
        return m.group(1), int(m.group(2)), bytes.fromhex(m.group(3))

    def locate(self, t: torch.Tensor) -> tuple[Allocation, int] | None:
        """(allocation, byte offset) if contiguous ``t`` lies wholly inside one of this rank's allocations."""
        p = t.data_ptr()
        for a in self.allocs:
            if a.base <= p < a.base + a.nbytes:  # the cheap test first: most tensors are elsewhere
                if p + t.numel() * t.element_size() <= a.base + a.nbytes and t.is_contiguous():
                    return a, p - a.base
                return None
        return None

    def close(self) -> None:
        for a in self.allocs:
            a.views.clear()
            for m in a.maps:
                try:
                    m.close()
                except BufferError:  # a tensor still views it: the GC unmaps it later
                    pass
        self.allocs = []
