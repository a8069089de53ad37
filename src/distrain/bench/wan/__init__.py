"""``distrain bench wan``: DDP against the DiLoCo forms on an emulated slow WAN (docs/slow_links.md).

    runs.py     the settings, the strategy table (one line per strategy: its ``distrain train`` flags),
                the checks before any cluster, and the run: a cluster of its own, one training job per
                strategy across it, one rank per node
    report.py   what a run folder's metrics.jsonl and summary.json say (the validation curve, bytes,
                compute utilisation), seconds to a target loss, the records, the table, the targets and
                the figure: pure functions, no process or cluster
"""
