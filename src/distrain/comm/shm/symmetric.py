"""Symmetric memory: buffers that every rank of a shared-memory group allocates alike and
every peer maps, so a collective works on them in place (no copy into slots and back).

The idea of torch's ``torch.distributed._symmetric_memory`` and of NCCL's registered
buffers (``ncclMemAlloc`` + window registration), on /dev/shm. Allocation is collective:
every rank of the group calls :meth:`Heap.empty` in the same order with the same size, so
allocation k has the same index and size on every rank, and a tensor at byte offset o of
allocation k on one rank has its counterpart at offset o of allocation k on each peer.

One allocation = one file ``/dev/shm/<segment name>-s<k>`` per rank, created and reserved
(fallocate: a full /dev/shm fails here, not with SIGBUS later), published in the group's store,
mapped by every peer, and unlinked by its owner once every peer has said it mapped it (the
mappings live on; the kernel frees the memory with the last one). If any rank cannot
allocate, every rank gets None and the reason (the caller falls back to ordinary memory on
every rank alike: a symmetric buffer on some ranks only would make the ranks take different
paths in the collectives).

Lifetime: an allocation lives as long as its transport (the group); there is no free.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import torch

from distrain.comm.shm import segment as seg_mod
from distrain.errors import CommError

ALIGN = 4096  # every allocation starts on a page


@dataclass
class Allocation:
    index: int
    nbytes: int
    base: int  # this rank's data_ptr of the allocation
    views: dict[int, torch.Tensor] = field(default_factory=dict)  # group rank -> uint8 view of its file
    maps: list[mmap.mmap] = field(default_factory=list)

    def code(self, offset: int) -> int:
        """A nonzero number naming (allocation, byte offset), the same on every rank for counterparts."""
        return (self.index + 1) << 40 | offset


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
        """
        sh = self.sh
        k = len(self.allocs) + self.failed
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        name = f"{sh.me.name}-s{k}"
        fd, why = None, ""
        try:
            fd = seg_mod.allocate_file(name, size)
        except (CommError, OSError) as e:
            why = f"rank {sh.me_global}: {e}"
        sh.store.set(self._key(k, sh.rank), f"! {why}" if fd is None else f"{name} {size}")
        others = {}
        for q in range(sh.size):
            if q != sh.rank:
                sh.store.wait([self._key(k, q)])
                others[q] = sh.store.get(self._key(k, q)).decode()
        path = os.path.join(seg_mod.SHM_DIR, name)
        bad = next((v[2:] for v in others.values() if v.startswith("!")), None)
        if fd is None or bad is not None:
            if fd is not None:
                os.close(fd)
                seg_mod.unlink_file(path)
            self.failed += 1
            return None, why or bad
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        mine = torch.frombuffer(mm, dtype=torch.uint8)
        alloc = Allocation(k, size, mine.data_ptr(), {sh.rank: mine}, [mm])
        for q, v in others.items():
            peer_name, peer_size = v.split(" ")
            if int(peer_size) != size:
                raise CommError(f"symmetric memory on rank {sh.me_global}: rank {sh.ranks[q]} allocated {peer_size} "
                                f"bytes as allocation {k}, this rank {size}; every rank must allocate the same sizes "
                                f"in the same order")
            try:
                pfd = os.open(os.path.join(seg_mod.SHM_DIR, peer_name), os.O_RDWR)
            except FileNotFoundError:
                raise CommError(f"symmetric memory on rank {sh.me_global}: rank {sh.ranks[q]}'s allocation "
                                f"{peer_name} is gone (did that rank exit?)") from None
            try:
                pm = mmap.mmap(pfd, size)
            finally:
                os.close(pfd)
            alloc.maps.append(pm)
            alloc.views[q] = torch.frombuffer(pm, dtype=torch.uint8)
        # every peer mapped this rank's file: unlink it (the mappings stay)
        sh.store.set(self._key(k, sh.rank, "/mapped"), "1")
        sh.store.wait([self._key(k, q, "/mapped") for q in range(sh.size)])
        seg_mod.unlink_file(path)
        self.allocs.append(alloc)
        return mine[:nbytes], ""

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
