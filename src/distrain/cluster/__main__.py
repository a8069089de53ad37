"""Node side of ``distrain cluster run``: ``python -m distrain.cluster K N I ENDPOINT RESTARTS SCRIPT...``.

Runs inside node I's namespace and hands over to :func:`distrain.launch.launch` (torchrun).
"""

from __future__ import annotations

import sys

from distrain.launch import launch


def main(argv: list[str]) -> int:
    k, n, i, endpoint, restarts, *script = argv
    return launch(int(k), script, nnodes=int(n), node_rank=int(i), rdzv_endpoint=endpoint,
                  max_restarts=int(restarts), rdzv_id="distrain-cluster")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
