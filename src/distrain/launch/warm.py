"""What the fork server imports once, so that no rank imports it again (``spawn``'s preload).

Every rank is forked from a server that has already imported these: a rank's own import
would cost each rank the same seconds of CPU, at every start. Measured on the 2-core machine
(cProfile of one gpt-tiny trainer rank, 2.5 s in all): the first ``torch.optim`` optimizer
imports torch._dynamo (1.4 s), and the loss plot imports matplotlib (0.9 s). Both are pure
imports (no threads, no open devices), safe to fork.

Rank 0 alone opens the metrics log before its first step (``MetricsLog(tensorboard=True)``: the import of
torch.utils.tensorboard, 0.25 s on a quiet host, 0.5-0.8 s beside other jobs), and so does a new rank 0 after an
elastic change, while the other ranks already wait in the step's all-reduce: with a short --collective-timeout
under load that wait ran out (a false loss; tests/test_elastic.py's stale-rank test with --collective-timeout 2
beside 5 busy processes on 2 cores: rank 0's log took 2.2-2.6 s in 4 of 8 runs, each a membership change (3, 3,
[], 0)). Imported here, the log is a SummaryWriter and a file (pure import too: no thread until a writer exists).
"""

import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it lazily)

try:  # the trainer's loss plot; pyplot picks its backend on first use, so a rank still chooses its own
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
except ImportError:  # matplotlib is optional for the library
    pass

try:  # rank 0's metrics log (trainer/metrics.py: TensorBoardLog), opened just before its first step
    import torch.utils.tensorboard  # noqa: F401
except ImportError:  # tensorboard is an optional extra
    pass
