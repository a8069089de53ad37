"""The training configuration: one dataclass, validated by ``validate`` (its rules: trainer/checks/).

Every ``distrain train`` flag maps onto a field of the same name (dashes for underscores).
Validation happens before any process is started or any process group is created, and
every error names the flag and how to fix it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from distrain.comm import ALGORITHM_NAMES, TRANSPORT_NAMES
from distrain.elastic.spec import SUPPORTED as ELASTIC_STRATEGIES
from distrain.factories import CUSTOM
from distrain.models.registry import DEFAULT_MODEL
from distrain.optim import DEFAULTS as OPTIMIZER_DEFAULTS
from distrain.optim import OPTIMIZERS
from distrain.trainer.choices import (  # noqa: F401  (LOCAL_RANKS_PER_CORE, SEED_MAX, local_rank_limit: re-exported)
    AUTOCASTS, CP_ALGORITHMS, DATASETS, DEFAULT_INNER_STEPS, DEVICES, DTYPES, INNER_STRATEGIES, LOCAL_RANKS_PER_CORE,
    LR_SCHEDULES, MODEL_DATA, OUTER_COMPRESSIONS, OUTER_OPTIMIZERS, SCHEDULES, SEED_MAX, STRATEGIES, VIRTUAL_STAGES, either,
    local_rank_limit)


def applicable(strategy: str, **flags) -> dict:
    """``flags`` (TrainConfig field names) without those ``strategy`` does not act on: what a tool that
    builds one config per strategy from shared settings passes (bench train, bench zero, ...)."""
    only = {f.name: f.metadata.get("only") for f in fields(TrainConfig)}
    return {k: v for k, v in flags.items() if not only.get(k) or strategy in only[k]}


def opt(default, help: str, choices=None, type=None, only: tuple[str, ...] = ()):
    """A config field with its flag's help text and allowed values (the CLI reads these). ``only``: the
    strategies the flag acts on; its help says so, and validate() refuses a value other than the default
    for any other strategy (a flag that does nothing is an error, not a silence)."""
    if only:
        help = f"{help} (--strategy {either(only)} only)"
    return field(default=default, metadata={"help": help, "choices": choices, "type": type, "only": only})


@dataclass
class TrainConfig:
    # what to train
    model: str = opt(DEFAULT_MODEL, "model preset, or PKG.MOD:FACTORY (your own: factory() -> nn.Module)",
                     choices=tuple(MODEL_DATA) + ("PKG.MOD:FACTORY",))
    data: str = opt("shakespeare", "data set name, a path to a .txt file / folder of .txt files, a token shard "
                                   "folder (`distrain data prepare`), or PKG.MOD:FACTORY (your own: factory() -> "
                                   "(train, val))",
                    choices=DATASETS + ("PATH", "PKG.MOD:FACTORY"))
    init_from: str = opt("", "start a new run (step 0, a fresh optimizer, this run's --data and --lr) from these "
                             "weights: a Hugging Face model folder, a run folder or a checkpoint file; the model is "
                             "the checkpoint's (docs/llama.md)", choices=("HF_DIR", "RUN_DIR", "FILE"))
    seq_len: int = opt(0, "language models: the training sequence length, the text cut into blocks of N tokens; the "
                          "model must have positions for N (0: the model's block size, at most 2048, with a note "
                          "when cut)")
    # how to parallelize
    strategy: str = opt("ddp", "way of training (ps-*: parameter servers; zero1-3: ZeRO stages; diloco: islands that "
                                     "synchronise every --inner-steps steps, docs/slow_links.md; local: no gradient "
                                     "exchange, a benchmark floor, not training)", choices=STRATEGIES)
    nproc: int = opt(2, "processes (ranks) in the job")
    device: str = opt("auto", "where each rank computes: auto = cuda:LOCAL_RANK when CUDA is visible (NCCL), "
                              "else cpu (Gloo)", choices=DEVICES)
    algorithm: str = opt("ring", "collective algorithm of our DDP and ZeRO (and of every --tp/--pp layout's "
                                 "collectives, and of DiLoCo's outer all-reduce)", choices=ALGORITHM_NAMES,
                         only=("ddp", "zero1", "zero2", "zero3", "diloco"))
    transport: str = opt("torch", "how ranks' bytes travel: torch (Gloo/NCCL), shm (shared memory between the "
                                  "ranks of one host), auto (shm inside a host, torch between hosts)",
                         choices=TRANSPORT_NAMES)
    bucket_cap_mb: float = opt(25.0, "gradient bucket size in MiB", only=("ddp", "torch-ddp", "zero1", "zero2",
                                                                          "zero3", "diloco"))
    compression: str | None = opt(None, "our DDP's gradients on the wire in this dtype (not with --tp/--pp)",
                                  choices=("bf16", "fp16"), type=str, only=("ddp",))
    servers: int = opt(1, "parameter servers; the other ranks work", only=("ps-sync", "ps-async"))
    max_staleness: int | None = opt(None, "bound on gradient staleness (none: unbounded)", type=int,
                                    only=("ps-async",))
    # DiLoCo (docs/slow_links.md): islands of nproc / islands ranks, DDP (or a dp x tp x pp grid) inside, an outer
    # step every inner_steps
    # (before --islands: a job that gives both to another strategy is told of this one first)
    inner_strategy: str = opt("ddp", "DiLoCo: what each island runs over its ranks: ddp, or zero1/zero2/zero3 (ZeRO "
                                     "over the island's dp group), with --tp/--pp/--cp inside the island too",
                              choices=INNER_STRATEGIES, only=("diloco",))
    islands: int = opt(0, "DiLoCo islands: data-parallel groups of --nproc / --islands consecutive ranks (DDP inside "
                          "over their fast links, or with --tp/--pp/--inner-strategy a grid); 0: every rank is an "
                          "island", only=("diloco",))
    inner_steps: int = opt(DEFAULT_INNER_STEPS, "DiLoCo: inner optimizer steps (--optimizer, each island its own) "
                                                "between outer steps (H)", only=("diloco",))
    outer_optimizer: str = opt("nesterov", "DiLoCo: the outer step on the islands' averaged parameter change: SGD "
                                           "with Nesterov momentum, or sgd (heavy-ball momentum, or none at "
                                           "--outer-momentum 0)", choices=OUTER_OPTIMIZERS, only=("diloco",))
    outer_lr: float = opt(0.7, "DiLoCo: the outer learning rate", only=("diloco",))
    outer_momentum: float = opt(0.9, "DiLoCo: the outer momentum, in [0, 1)", only=("diloco",))
    outer_compression: str | None = opt(None, "DiLoCo: the outer gradient on the wire: bf16 (summed by the ring), int8 or int4 (block-wise, quantized)",
                                        choices=OUTER_COMPRESSIONS, type=str, only=("diloco",))
    # Streaming DiLoCo (docs/slow_links.md): the parameters in fragments, each synchronised at its own offset
    fragments: int = opt(1, "DiLoCo: the parameters in P fragments (contiguous whole tensors, balanced by size), "
                            "fragment p synchronised every --inner-steps steps at offset p x H / P (Streaming "
                            "DiLoCo); 1: all at once", only=("diloco",))
    overlap_steps: int = opt(0, "DiLoCo: a fragment's outer all-reduce runs while this many inner steps go on, "
                                "then is applied (tau, 0..H-1); 0: each exchange blocks", only=("diloco",))
    overlap_alpha: float = opt(0.5, "DiLoCo with --overlap-steps: the merge after an overlapped exchange, local = "
                                    "alpha x local + (1 - alpha) x global, in [0, 1]", only=("diloco",))
    # model parallelism (GPT and Llama presets, your model with .layers / a tp_plan, Hugging Face decoders):
    # dp * cp * tp * pp = nproc; dp = 0 means nproc // (cp * tp * pp)
    dp: int = opt(0, "data-parallel size of the dp x cp x tp x pp grid (0: nproc / (cp * tp * pp))")
    tp: int = opt(1, "tensor-parallel size (GPT and Llama presets, Hugging Face Llama-family models, or a model with "
                     "a tp_plan)")
    pp: int = opt(1, "pipeline-parallel stages (GPT and Llama presets, or a model with .layers run in order)")
    cp: int = opt(1, "context-parallel size: each sequence split across this many ranks, 2 x cp chunks of it, rank i "
                     "holding chunks i and 2cp-1-i (GPT and Llama presets, or a model with a cp_plan); 2 x cp must "
                     "divide the sequence length (the model's block size)")
    cp_algorithm: str = opt("ring", "attention across the cp ranks: ring (keys and values passed around the ring, "
                                    "any head count) or all-to-all (Ulysses: heads exchanged for sequence; cp must "
                                    "divide the query and key/value heads per tp rank)", choices=CP_ALGORITHMS)
    ep: int = opt(1, "expert-parallel size (mixture-of-experts models, e.g. llama-moe-tiny): each expert on one of ep "
                     "ranks, tokens sent to it all-to-all; borrows ranks from dp x cp, so ep must divide dp x cp and "
                     "the number of experts")
    microbatches: int = opt(1, "micro-batches per pipeline step; must divide the per-replica batch")
    schedule: str = opt("1f1b", "pipeline schedule (interleaved: 1F1B over --virtual-stages chunks of layers per "
                                "rank, Megatron's virtual stages; zb-h1: zero bubble, backward split into input- "
                                "and weight-gradient passes)", choices=SCHEDULES)
    virtual_stages: int = opt(VIRTUAL_STAGES, "--schedule interleaved: model chunks per pipeline rank (chunk j on rank j mod "
                                 "--pp); the model needs at least pp x this many layers, and --microbatches must be "
                                 "a multiple of --pp")
    trace: str = opt("", "pipeline runs: write the last step's timeline as a Chrome trace (JSON for "
                         "chrome://tracing or Perfetto) to this path")
    gantt: str = opt("", "pipeline runs: draw the last step's timeline as a Gantt chart (PNG) to this path")
    # optimization
    steps: int = opt(1200, "optimizer steps")
    batch_size: int = opt(32, "global batch size (the same whatever nproc is, so runs compare)")
    lr: float = opt(OPTIMIZER_DEFAULTS["lr"], "learning rate")
    optimizer: str = opt(OPTIMIZER_DEFAULTS["optimizer"], "optimizer", choices=OPTIMIZERS)
    weight_decay: float = opt(OPTIMIZER_DEFAULTS["weight_decay"], "weight decay")
    momentum: float = opt(OPTIMIZER_DEFAULTS["momentum"], "SGD momentum")
    seed: int = opt(0, "seed of the model's initialisation and of the batch order")
    dtype: str = opt("float32", "parameter and activation dtype", choices=DTYPES)
    loss: str = opt("auto", "loss: auto (the data's: next-token cross-entropy for text, cross-entropy for "
                            "classes), cross-entropy, mse, or PKG.MOD:FN (fn(output, target) -> scalar)",
                    choices=("auto", "cross-entropy", "mse", "PKG.MOD:FN"))
    lr_schedule: str = opt("constant", "learning rate after the warm-up: constant, or cosine decay to --min-lr "
                                       "at the last step", choices=LR_SCHEDULES)
    warmup_steps: int = opt(0, "steps of linear learning-rate warm-up from lr/warmup to lr")
    min_lr: float = opt(0.0, "the learning rate the cosine schedule ends at")
    grad_clip: float = opt(0.0, "clip gradients to this global L2 norm (over every shard; 0: off)")
    accum_steps: int = opt(1, "gradient accumulation: micro-batches per rank and step",
                           only=("single", "ddp", "torch-ddp"))
    activation_checkpointing: bool = opt(False, "recompute each transformer block's activations in backward instead "
                                                "of keeping them (less memory, about one more forward; bitwise the "
                                                "same results)")
    autocast: str = opt("none", "mixed precision: run forward and loss under torch.autocast in bf16",
                        choices=AUTOCASTS)
    layout_invariant: bool = opt(False, "the same bits whatever the layout: every step's loss, the gradient norm, the "
                                        "parameters and optimizer state equal one process's bit for bit "
                                        "(docs/determinism.md)")
    invariant_tp: bool = opt(False, "--layout-invariant across --tp 1, 2 and 4 as well: every layout, one process too, "
                                    "computes each tensor-parallel reduction as fixed chunks (slower; "
                                    "docs/determinism.md)")
    units: int = opt(0, "--layout-invariant: the global batch as this many equal units of work, the same in every "
                        "layout (at most this many data-parallel replicas); 0: the largest number up to 8 that "
                        "divides --batch-size")
    # bookkeeping
    out: str = opt("runs/latest", "run folder: metrics.jsonl, loss.png, summary.json, checkpoints")
    overwrite: bool = opt(False, "replace the previous run's files in a non-empty --out")
    log_every: int = opt(10, "steps per metrics flush (one small all-reduce of the losses)")
    eval_every: int = opt(200, "steps between validation losses (0: never; always at the end otherwise)")
    eval_batches: int = opt(8, "validation batches per evaluation")
    ckpt_every: int = opt(0, "steps between checkpoints (0: only at the end)")
    resume: bool | str = opt(False, "continue the run in --out from its newest checkpoint; `auto`: only if there "
                                    "is one (the default under `distrain launch --max-restarts`)",
                             choices=("auto", "yes", "no"))
    reshard: bool = opt(False, "with --resume: load a checkpoint written with another layout (--nproc, --dp/--tp/"
                               "--pp, --strategy among single, ddp, torch-ddp, zero1-3) into this run's layout")
    sample_chars: int = opt(300, "characters of generated text at the end (text models; 0: none)")
    progress: bool = opt(True, "show a progress bar on a terminal (without one, or with --no-progress: a plain line "
                               "every --log-every steps and each validation loss; with --no-report too: nothing)")
    report: bool = opt(True, "print the summary table (and sample) at the end")
    timeout: float = opt(0.0, "whole-run limit in seconds (local spawn); 0: no limit")
    check_replicas: int = opt(0, "every this many steps, and before every checkpoint, the ranks that hold the same "
                                 "parameters and optimizer state compare a hash of their bits; a mismatch (silent "
                                 "data corruption) stops the job naming the ranks (0: off; docs/fault_tolerance.md)")
    collective_timeout: float = opt(300.0, "a collective not completed in this many seconds stops the job")
    elastic: str = opt("", "MIN:MAX: survive the loss of ranks without a restart, going on while at least MIN remain "
                           "(docs/fault_tolerance.md)", choices=("MIN:MAX",), only=ELASTIC_STRATEGIES)
    elastic_replace: int = opt(0, "--elastic: replacement ranks the top process may start, each while the job is "
                                  "below MAX; they join at a step boundary, healed from a live peer")

    # -- derived ---------------------------------------------------------------------------
    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1

    @property
    def island_grid(self) -> bool:
        """--strategy diloco whose islands are grids (--tp/--pp or --inner-strategy zeroN inside each island:
        engines/diloco_grid.py), not plain DDP islands; --invariant-tp too (the grid engine runs the canonical
        tensor-parallel layers, one rank per island too)."""
        return self.strategy == "diloco" and (self.model_parallel or self.dp > 0 or self.inner_strategy != "ddp"
                                              or self.invariant_tp)

    @property
    def dp_size(self) -> int:
        return self.dp or max(1, self.nproc // (self.tp * self.pp * self.cp))

    @property
    def workers(self) -> int:
        """Data-parallel replicas: each takes a slice of the global batch."""
        if self.strategy.startswith("ps-"):
            return self.nproc - self.servers
        return self.dp_size if (self.model_parallel or self.dp) else self.nproc

    @property
    def data_kind(self) -> str:
        """text, fashion-mnist, digits, or custom (your own data: a spec or distrain.train's objects)."""
        if self.data == CUSTOM or ":" in self.data:
            return CUSTOM
        return "text" if self.data not in ("fashion-mnist", "digits") else self.data

    @property
    def custom_model(self) -> bool:
        return self.model == CUSTOM or ":" in self.model

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- validation ------------------------------------------------------------------------
    def validate(self, launched: tuple[int, int] | None = None,
                 fashion_mnist_root: str | None = None, available_memory: float | None = None) -> "TrainConfig":
        """Every rule (trainer/checks/, one module per concern); ConfigError, one line naming the flag and
        the fix, for the first one broken; returns self. What the process's environment says comes as
        parameters, read at the process edge (``cfg.validate(**distrain.runtime.validate_args())``):
        ``launched``, (rank, world size) when this process is one rank of a launched job (a local job,
        None, spawns at most LOCAL_RANKS_PER_CORE ranks per core; --elastic is not launched);
        ``fashion_mnist_root``, $DISTRAIN_FASHION_MNIST (None: the default folder); ``available_memory``,
        this host's available bytes, which the ranks a local job spawns must fit (None: not checked)."""
        from distrain.trainer.checks import validate

        validate(self, launched=launched, fashion_mnist_root=fashion_mnist_root, available_memory=available_memory)
        return self
