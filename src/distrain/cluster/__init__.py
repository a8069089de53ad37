"""An emulated cluster on one Linux host, and multi-node runs on it.

* :mod:`distrain.cluster.netns`: ``up``/``down``/``status`` of N network namespaces joined
  by veth pairs to a bridge, every link shaped with ``tc tbf`` (needs root and iproute2;
  :func:`unavailable_reason` says why not, and tests skip with it);
* :mod:`distrain.cluster.runner`: one command on every node through ``distrain launch``
  (torchrun's c10d rendezvous across the namespaces), naming the node that failed;
* distrain/cli/cluster.py: ``distrain cluster up|down|status|run`` (the command line, above this package);
* :mod:`distrain.cluster.fixture`: the pytest fixture ``emulated_cluster``.
"""

from distrain.cluster.netns import ClusterError, ClusterSpec, down, status, unavailable_reason, up
from distrain.cluster.runner import RunResult, run

__all__ = ["ClusterError", "ClusterSpec", "RunResult", "down", "run", "status", "unavailable_reason", "up"]
