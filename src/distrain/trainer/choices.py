"""The values ``distrain train``'s flags may take and the limits they meet (pure constants).

TrainConfig's fields (trainer/config.py) name their choices from here and the checks
(trainer/checks/) test against them; both import this module, neither the other's.
"""

from __future__ import annotations

import os

STRATEGIES = ("single", "ddp", "torch-ddp", "ps-sync", "ps-async", "zero1", "zero2", "zero3", "local", "diloco")
OUTER_OPTIMIZERS = ("nesterov", "sgd")  # --outer-optimizer (diloco): torch SGD, with Nesterov momentum or without
OUTER_COMPRESSIONS = ("bf16", "int8", "int4")  # --outer-compression (diloco): the outer gradient on the wire
INNER_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")  # --inner-strategy (diloco): each island's data parallelism
DEFAULT_INNER_STEPS = 100  # --inner-steps (diloco): the paper trains 500; short runs need fewer
DATASETS = ("shakespeare", "fashion-mnist", "digits")
DTYPES = ("float32", "float64")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")
AUTOCASTS = ("none", "bf16")
CP_ALGORITHMS = ("ring", "all-to-all")  # --cp-algorithm: parallel/context_parallel/ring.py, ulysses.py
# zb-h1: zero bubble (B / W split), parallel/pipeline_parallel/zero_bubble.py; interleaved: v chunks of layers per
# rank (--virtual-stages, Megatron's virtual stages), parallel/pipeline_parallel/interleaved.py
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
VIRTUAL_STAGES = 2  # --virtual-stages' default: model chunks per pipeline rank under --schedule interleaved
# which data each model preset reads (input sizes must match)
MODEL_DATA = {"gpt-tiny": "text", "gpt-small": "text", "mlp": "fashion-mnist", "mlp-tiny": "digits",
              "llama-tiny": "text", "llama-small": "text", "llama-moe-tiny": "text"}


# --seed: torch.manual_seed took up to 2**64-1 (beyond, the ranks died with "Overflow when unpacking long long"), an
# int64 tensor up to 2**63-1, and the batch sampler (numpy) refuses negative seeds: 0..2**63-1 fits all of them
SEED_MAX = 2**63 - 1
LOCAL_RANKS_PER_CORE = 16  # a spawned (one-machine) job: 64 ranks on 2 cores trained, slowly; 1000 did not start


def local_rank_limit() -> tuple[int, int]:
    """(the most ranks a local job may spawn, the cores this process may use)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return LOCAL_RANKS_PER_CORE * cores, cores


def either(names) -> str:
    """``a``, ``a or b``, ``a, b or c``: the names in a sentence."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def zero_stage(strategy: str) -> int:
    """The ZeRO stage a --strategy or --inner-strategy names: ``zeroN`` -> N, any other (ddp, ...) -> 0."""
    return int(strategy.removeprefix("zero")) if strategy.startswith("zero") else 0
