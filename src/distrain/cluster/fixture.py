"""The pytest fixture ``emulated_cluster``: build clusters for one test, remove them after it.

Use: ``from distrain.cluster.fixture import emulated_cluster`` in a test module, then::

    def test_x(emulated_cluster):
        spec = emulated_cluster(nodes=2, link="200mbit")

Without root or iproute2 the test is skipped with :func:`netns.unavailable_reason`.
Cluster names are ``dtt<pid>k<n>``; clusters of a test process that died (its pid is gone)
are removed first, so a crashed or killed test run leaves nothing behind for long.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from distrain.cluster import netns

_TEST_NAME = re.compile(r"^(dtt(\d+)k\d+)-")


def remove_stale() -> list[str]:
    """Remove test clusters whose creating process is gone; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = set()
    for line in out.splitlines():
        m = _TEST_NAME.match(line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            stale.add(m.group(1))
    for name in sorted(stale):
        netns.down(name)
    return sorted(stale)


@pytest.fixture
def emulated_cluster():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    remove_stale()
    made: list[str] = []

    def make(nodes: int = 2, link: str | None = "1gbit", mtu: int = 9000, delay: str | None = None,
             jitter: str | None = None, loss: str | None = None, queue: str | None = None) -> netns.ClusterSpec:
        name = f"dtt{os.getpid()}k{len(made)}"
        made.append(name)
        return netns.up(netns.ClusterSpec.build(name, nodes, link, mtu, delay=delay, jitter=jitter, loss=loss,
                                                queue=queue))

    yield make
    for name in made:
        netns.down(name)
