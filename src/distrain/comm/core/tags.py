"""The one map of point-to-point tags: which range belongs to whom.

Tags are non-negative int32 (Gloo's limit). Messages between one pair of ranks are matched
by (group, tag), so two users of the same pair must never share a tag while both have
messages in flight. The ranges:

========================  =====================  =============================================
range                     owner                  how tags inside are used
========================  =====================  =============================================
[0, 2**30)                user point-to-point    ``send``/``recv``/``isend``/``irecv``; default 0
[0xA000, 0xA100)          parameter server       one tag per message kind (parallel/parameter_server/ps.py)
[0xA100, 0xA101)          elastic replica        a ZeRO rank's piece to the next rank (elastic/pieces.py)
[2**19, 2**20)            pipeline (default)     ``tag_base + 2 + 2k (+1 for gradients)``
[2**20, 2**20 + 16)       context parallelism    one tag per message kind (parallel/context_parallel/ring.py)
[2**30, 2**31)            collectives            COLLECTIVE.start + call sequence number of
                                                 the group (wraps), see group.py
========================  =====================  =============================================

The parameter-server, elastic-replica, pipeline and context-parallel ranges sit inside the user range
because they are sent through the public P2P API (the all-to-alls of Ulysses and of expert parallelism are collectives:
``all_to_all_single(algorithm="p2p")``, in the collectives' range); they are reserved by convention (a user mixing raw P2P with
distrain's pipeline or parameter server on one group should stay below 0xA000).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TagRange:
    """A half-open range [start, stop) of P2P tags and who uses it."""

    name: str
    start: int
    stop: int

    def __contains__(self, tag: int) -> bool:
        return self.start <= tag < self.stop

    def at(self, offset: int) -> int:
        """The tag ``offset`` places into this range (raises if it falls outside)."""
        tag = self.start + offset
        if not self.start <= tag < self.stop:
            raise ValueError(f"tag offset {offset} is outside the {self.name} range [{self.start}, {self.stop})")
        return tag


USER = TagRange("user point-to-point", 0, 1 << 30)  # torch allows [0, 2**31); the top half is ours
PARAMETER_SERVER = TagRange("parameter server", 0xA000, 0xA100)
ELASTIC_REPLICA = TagRange("elastic replica", 0xA100, 0xA101)
PIPELINE = TagRange("pipeline", 1 << 19, 1 << 20)
CONTEXT_PARALLEL = TagRange("context parallelism", 1 << 20, (1 << 20) + 16)
COLLECTIVE = TagRange("collectives", 1 << 30, 1 << 31)

TABLE: tuple[TagRange, ...] = (USER, PARAMETER_SERVER, ELASTIC_REPLICA, PIPELINE, CONTEXT_PARALLEL, COLLECTIVE)


def collective_tag(seq: int) -> int:
    """The tag of a group's collective call number ``seq`` (wraps inside COLLECTIVE)."""
    return COLLECTIVE.start + seq % (COLLECTIVE.stop - COLLECTIVE.start)
