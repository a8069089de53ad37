"""The ``dist`` module a tutorial script uses: torch.distributed, or distrain.comm with one algorithm.

TUTORIAL_DIST=torch|distrain and TUTORIAL_ALGORITHM=native|star|ring|tree choose (set by
tests/test_tutorials.py); the scripts themselves read like the tutorials: ``dist.all_reduce(t)``.
"""

import os
import sys

if os.environ.get("TUTORIAL_DIST", "torch") == "distrain":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dist_shim import make_shim

    dist = make_shim(os.environ.get("TUTORIAL_ALGORITHM", "native"))
else:
    import torch.distributed as dist  # noqa: F401
