"""The explicit seams of distrain.comm: the algorithm registry, the tag map, shared helpers,
and a transport injected per group (a counting fake carries every algorithm unchanged)."""

from __future__ import annotations

import pytest
import torch

import distrain
from distrain import comm
from distrain.comm.algorithms import cost
from distrain.comm.core import registry
from distrain.comm.core import tags
from distrain.comm.core.transport import TorchTransport
from distrain.comm.core.util import check_int, nbytes
from distrain.errors import ConfigError


def test_registry_is_what_everyone_reads():
    assert comm.ALGORITHM_NAMES == ("native", *registry.REGISTRY)
    for name, alg in registry.REGISTRY.items():
        assert registry.missing_functions(alg) == [], name
        # the cost model answers for every registered algorithm and collective
        for coll in registry.OPERATIONS:
            s, r = cost.traffic(coll, name, 3, 1, 7, elem=4, root=2)
            assert s >= 0 and r >= 0
    assert registry.get("native", "all_reduce") is None
    with pytest.raises(ConfigError, match=r"all_reduce: unknown algorithm 'bogus'; use one of native, star, ring, tree"):
        registry.get("bogus", "all_reduce")

    class Half:  # a module-like object missing functions is reported by name
        broadcast = staticmethod(lambda pc, buf, root: None)
    assert registry.missing_functions(Half) == ["reduce", "all_reduce", "scatter", "gather", "all_gather",
                                                "reduce_scatter", "traffic"]


def test_tag_ranges_are_one_consistent_map():
    from distrain.parallel.parameter_server import ps
    from distrain.parallel.pipeline_parallel import pipeline

    assert tags.USER.stop == tags.COLLECTIVE.start  # user tags end where collectives begin
    assert tags.COLLECTIVE.stop <= 2 ** 31  # Gloo tags are non-negative int32
    # the reserved ranges lie inside the user range and do not overlap each other
    for r in (tags.PARAMETER_SERVER, tags.ELASTIC_REPLICA, tags.PIPELINE):
        assert tags.USER.start <= r.start < r.stop <= tags.USER.stop
    assert tags.PARAMETER_SERVER.stop <= tags.ELASTIC_REPLICA.start < tags.ELASTIC_REPLICA.stop <= tags.PIPELINE.start
    # the parallel code uses tags inside its ranges
    for t in (ps.TAG_HELLO, ps.TAG_REQ, ps.TAG_VERSION, ps.TAG_PULL, ps.TAG_PUSH_HDR, ps.TAG_PUSH):
        assert t in tags.PARAMETER_SERVER
    assert pipeline.DEFAULT_TAG_BASE in tags.PIPELINE
    assert tags.collective_tag(0) == tags.COLLECTIVE.start
    assert tags.collective_tag(tags.COLLECTIVE.stop - tags.COLLECTIVE.start + 5) == tags.COLLECTIVE.start + 5
    with pytest.raises(ValueError, match=r"outside the pipeline range"):
        tags.PIPELINE.at(1 << 20)


def test_shared_helpers():
    assert nbytes(torch.zeros(3, 5, dtype=torch.float64)) == 120
    assert nbytes(torch.zeros(10, dtype=torch.bfloat16)[::2]) == 10
    assert check_int(3, "x", "f", 0, 4) == 3
    for bad in (True, 4, -1, 2.0, "1"):
        with pytest.raises(ConfigError, match=r"^f: x must be an int in \[0, 4\), got "):
            check_int(bad, "x", "f", 0, 4)


class CountingTransport(TorchTransport):
    """A fake injected with set_transport: torch's P2P underneath, counting every message."""

    name = "counting"

    def __init__(self):
        self.sent = self.received = 0

    def isend(self, tensor, dst, group, tag):
        self.sent += 1
        return super().isend(tensor, dst, group, tag)

    def irecv(self, tensor, src, group, tag):
        self.received += 1
        return super().irecv(tensor, src, group, tag)


def _injected(rank: int) -> list:
    import torch.distributed as dist

    P = dist.get_world_size()
    fake = CountingTransport()
    comm.set_transport(fake)
    out = []
    for alg in registry.REGISTRY:
        with comm.ledger() as led:
            t = torch.full((7,), float(rank + 1))
            comm.all_reduce(t, algorithm=alg)
        out.append((alg, t.tolist(), led.total().msgs_sent, led.total().msgs_recv))
    out.append(("totals", fake.sent, fake.received, comm.transport_of()))
    try:
        comm.set_transport("torch")
        out.append("switching after first use did not raise")
    except ConfigError as e:
        out.append(str(e))
    return out


@pytest.mark.timeout(120)
def test_injected_transport_carries_every_algorithm():
    P = 3
    res = distrain.spawn(_injected, P, timeout=90)
    want = [float(sum(range(1, P + 1)))] * 7
    for r, rows in enumerate(res):
        msgs = 0
        for alg, got, sent, received in rows[:-2]:
            assert got == want, (r, alg)
            msgs += sent
        assert rows[-2] == ("totals", msgs, sum(x[3] for x in rows[:-2]), "counting")
        assert rows[-1] == ("set_transport: the group of global ranks [0, 1, 2] already uses transport "
                            "'counting'; choose the transport before the group's first message")


def test_a_host_without_shared_memory_refuses_shm_and_auto_says_it_falls_back(monkeypatch, caplog):
    """transport 'shm' where it cannot work: one line saying why and what to use; 'auto': torch's P2P,
    said once in the log (not silently)."""
    import logging

    from distrain.comm.core import transport

    monkeypatch.setattr(transport, "_shm_factory", (lambda: "/dev/shm does not exist", None))
    monkeypatch.setattr(transport, "_fallbacks_said", set())
    with pytest.raises(ConfigError, match=r"^transport 'shm' cannot be used here: /dev/shm does not exist; use "
                                          r"transport 'torch' or 'auto'$"):
        transport.build("shm", None)
    with caplog.at_level(logging.WARNING, logger="distrain.comm"):
        assert transport.build("auto", None) is transport.TORCH
        assert transport.build("auto", None) is transport.TORCH
    said = [r.getMessage() for r in caplog.records if r.name == "distrain.comm"]
    assert said == ["transport 'auto' uses torch's point-to-point here: shared memory cannot be used "
                    "(/dev/shm does not exist)"]
