"""``TrainConfig.validate``'s rules, each owned by the module named for what it checks.

* flags.py: each flag on its own (a name among its choices, a number in its range, a PKG.MOD:NAME that imports)
* start.py: what a run starts from (--init-from, --resume, --reshard)
* strategy.py: the strategy's own rules (the flags it acts on, its process counts, --elastic)
* diloco.py: --strategy diloco's flags (islands, inner steps, the outer optimizer)
* features.py: training features against each other and the machine (autocast, zb-h1, activation
  checkpointing, --trace/--gantt, --device cuda)
* invariant.py: --layout-invariant's coverage and its units of work
* sequence.py: --seq-len against the model's positions and the data (the default cut to 2048)
* layout.py: ranks, the dp x cp x tp x pp grid, the model's split (--schedule interleaved's chunks), the
  batch's division (--accum-steps)
* data.py: model and data fit each other, and the data is installed
* memory.py: the job's ranks can hold the model on this host (a lower bound against its available memory)

:func:`validate` runs them in that order of dependence (a later check may rely on an earlier
one's values: a known model, a positive --tp, ...); the first broken rule raises a one-line
ConfigError naming the flag and the fix. Nothing here reads the environment: what the process's
environment says (``launched``, ``fashion_mnist_root``) comes as parameters, read at the process
edge (distrain.runtime.validate_args); so does this host's available memory (``distrain train`` passes
runtime.available_memory()).
"""

from __future__ import annotations

from distrain.trainer.checks import data, diloco, features, flags, invariant, layout, memory, sequence, start, strategy


def validate(cfg, launched: tuple[int, int] | None = None, fashion_mnist_root: str | None = None,
             available_memory: float | None = None) -> None:
    """Every rule for ``cfg`` (a TrainConfig). ``launched``: (rank, world size) when this process is
    one rank of a launched job, None when it spawns the ranks (runtime.launched_rank);
    ``fashion_mnist_root``: $DISTRAIN_FASHION_MNIST, None for the default folder; ``available_memory``:
    bytes this host can give the ranks (runtime.available_memory), None: not checked."""
    flags.check_strategy_name(cfg)
    start.check_start(cfg)  # before the model's name: --init-from's checkpoint may name it
    flags.check_names(cfg)
    flags.check_importable(cfg)
    flags.check_nproc(cfg)
    flags.check_numbers(cfg)
    start.check_resume(cfg)
    flags.check_bookkeeping(cfg)
    flags.check_schedule_name(cfg)
    flags.check_optimization(cfg)
    flags.check_grid_sizes(cfg)
    flags.check_batch_size(cfg)

    strategy.check_elastic(cfg, launched)
    strategy.check_processes(cfg)
    strategy.check_applies(cfg)
    strategy.check_replicas(cfg)
    diloco.check_diloco(cfg)

    features.check_features(cfg)
    features.check_device(cfg)
    invariant.check_invariant(cfg)

    sequence.check_seq_len(cfg, launched)

    layout.check_local_ranks(cfg, launched)
    layout.check_experts(cfg)
    layout.check_grid(cfg)
    layout.check_preset_split(cfg)
    layout.check_interleaved(cfg)
    layout.check_accumulation(cfg)
    layout.check_batch(cfg)

    data.check_model_data(cfg)
    data.check_installed(cfg, fashion_mnist_root)

    memory.check_memory(cfg, available_memory, launched)
