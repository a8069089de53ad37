"""What the fork server imports once, so that no rank imports it again (``spawn``'s preload).

Every rank is forked from a server that has already imported these: a rank's own import
would cost each rank the same seconds of CPU, at every start. Measured on the 2-core machine
(cProfile of one gpt-tiny trainer rank, 2.5 s in all): the first ``torch.optim`` optimizer
imports torch._dynamo (1.4 s), and the loss plot imports matplotlib (0.9 s). Both are pure
imports (no threads, no open devices), safe to fork.
"""

import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it lazily)

try:  # the trainer's loss plot; pyplot picks its backend on first use, so a rank still chooses its own
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
except ImportError:  # matplotlib is optional for the library
    pass
