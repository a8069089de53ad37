"""``distrain bench comm``: collective time and bandwidth, ours beside torch's.

    collectives.py  the flags, the spawned ranks, the report (what the command runs)
    timing.py       the per-rank side: one (op, size) cell timed on every rank
    report.py       nccl-tests' sizes and bus bandwidth, the tables and the plot (pure)
    predict.py      --predict: the cost model's time beside every measured one
"""
