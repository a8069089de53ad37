"""What the fork server imports once, so that no rank imports it again (``spawn``'s preload).

Every rank is forked from a server that has already imported these: a rank's own import
would cost each rank the same seconds of CPU, at every start. Measured on the 2-core machine
(cProfile of one gpt-tiny trainer rank, 2.5 s in all): the first ``torch.optim`` optimizer
imports torch._dynamo (1.4 s), the loss plot imports matplotlib (0.9 s), and rank 0's metrics log
imports TensorBoard's writer when it is installed (0.3 s). All are pure imports (no threads, no open
devices), safe to fork.

Rank 0 alone opens the metrics log before its first step (``MetricsLog(tensorboard=True)``: the import of
torch.utils.tensorboard, 0.25 s on a quiet host, 0.5-0.8 s beside other jobs), and so does a new rank 0 after an
elastic change, while the other ranks already wait in the step's all-reduce: with a short --collective-timeout
under load that wait ran out (a false loss; tests/test_elastic.py's stale-rank test with --collective-timeout 2
beside 5 busy processes on 2 cores: rank 0's log took 2.2-2.6 s in 4 of 8 runs, each a membership change (3, 3,
[], 0)). Imported here, the log is a SummaryWriter and a file (pure import too: no thread until a writer exists).

The fork server ends when its last client (the process that spawned the ranks) is gone, by raising
SystemExit: the interpreter's finalization of torch, torch._dynamo and matplotlib then cost it 1.1-1.4 s
of CPU after every ``distrain train`` (measured on the 2-core host, its CPU ticks in /proc at the
client's exit and at its own), while it holds nothing to flush or release (its ranks are forked
children that end through ``os._exit``). Imported by the fork server, this module makes it end at its
first exit handler instead (registered last, it runs first).
"""

import atexit
import os
import sys
from multiprocessing import forkserver

import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it lazily)

try:  # the trainer's loss plot; pyplot picks its backend on first use, so a rank still chooses its own
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
except ImportError:  # matplotlib is optional for the library
    pass

try:  # rank 0's metrics log (trainer/metrics.py: TensorBoardLog), opened just before its first step
    import torch.utils.tensorboard  # noqa: F401
except ImportError:
    pass


def _imported_by_the_fork_server() -> bool:
    """Whether this import runs inside multiprocessing's fork server (its preload), not in a process
    that imports every module (which must keep its own exit status and finalization)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _end_now(server: int = os.getpid()) -> None:
    """The fork server's last exit handler to run: skip its finalization. A rank forked from it inherits the
    handler and may run the exit handlers itself (runtime.leave): there it does nothing."""
    if os.getpid() == server:
        os._exit(0)


if _imported_by_the_fork_server():
    atexit.register(_end_now)
