"""The job fits this host's memory: refused before any rank starts when it cannot, not by the OOM killer.

A lower bound of what the ranks this process spawns hold together, from the model's parameter count
(built on the meta device: no memory) and the run's dtype (4 bytes a float32, 8 a float64), counting
what the strategies actually keep:

* weights, one copy per replica (``--nproc / (tp x pp)`` of them; tp and pp cut a replica, ep its
  experts, counted as if it cut all of it), one copy in all under zero3 (sharded);
* gradients of the trainable parameters, the same, one copy in all under zero2 and zero3;
* optimizer states per trainable parameter: AdamW 2 (its moments), SGD 1 with momentum and 0 without;
  one copy per replica, one in all under zero1-3 (sharded over the data-parallel group);
* a parameter server job (ps-sync, ps-async): each worker holds the weights and gradients, the servers
  one sharded copy of the weights and the optimizer states.

Activations, communication buffers, the top process and the allocator's slack are not counted, so a
job refused here could not have fitted; a job that passes may still not fit. The available memory
(the kernel's MemAvailable) is read at the process edge (``distrain train`` passes
``distrain.runtime.available_memory()``); a rank of a launched job, a job on CUDA devices, or your own
model (built by your factory) is not checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distrain.errors import ConfigError

BYTES = {"float32": 4, "float64": 8}
ZERO = {"zero1": 1, "zero2": 2, "zero3": 3}
PS = ("ps-sync", "ps-async")
DATA_PARALLEL = ("ddp", "torch-ddp", "zero1", "zero2")  # strategies that ZeRO trains the same way


@dataclass(frozen=True)
class Job:
    """What the memory a job needs depends on: its model's size and how its ranks hold it."""
    params: int  # all the model's parameters
    trainable: int  # those with gradients and optimizer states
    dtype: str
    strategy: str
    nproc: int
    model_parallel: int  # tp x pp (x ep): the ranks one replica is cut over
    servers: int
    optimizer: str
    momentum: float

    @property
    def states(self) -> int:
        """Optimizer states per trainable parameter."""
        return 2 if self.optimizer == "adamw" else int(self.momentum != 0)

    def lower_bound(self) -> float:
        """Bytes the job's ranks hold at least, together (see the module's docstring)."""
        b, n, g = BYTES[self.dtype], self.params, self.trainable
        if self.strategy in PS:
            workers = self.nproc - self.servers
            return b * (workers * (n + g) + n + self.states * g)
        replicas = max(1, self.nproc // self.model_parallel)
        stage = ZERO.get(self.strategy, 0)
        copies = lambda sharded_from: 1 if stage >= sharded_from else replicas  # noqa: E731
        return b * (n * copies(3) + g * copies(2) + self.states * g * copies(1))

    def describe(self) -> str:
        what = {2: "AdamW's 2 states", 1: "SGD's momentum", 0: "no optimizer state"}[self.states]
        return (f"{self.params:,} {self.dtype} parameters, their gradients and {what} under --strategy "
                f"{self.strategy} on {self.nproc} rank(s)")


def job(cfg, params: int, trainable: int) -> Job:
    # ep cuts the experts only; counting it as cutting everything keeps the bound a lower one
    return Job(params, trainable, cfg.dtype, cfg.strategy, cfg.nproc, max(1, cfg.tp * cfg.pp * cfg.ep), cfg.servers,
               cfg.optimizer, cfg.momentum)


def count_parameters(cfg) -> tuple[int, int]:
    """(parameters, trainable parameters) of the model ``cfg.model`` names, built on the meta device."""
    from distrain.checkpoint import init_from
    from distrain.models.meta import shapes_only

    with shapes_only():
        model = init_from.build_model(cfg)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def fixes(j: Job, available: float) -> list[str]:
    """The changes of flags that would make ``j`` fit ``available`` bytes, the smallest change of each kind."""
    out = []
    if j.strategy not in PS:
        if j.model_parallel == 1 and j.strategy in DATA_PARALLEL:  # ZeRO: the same training, states sharded
            stage = next((s for s in ("zero1", "zero2", "zero3") if ZERO[s] > ZERO.get(j.strategy, 0)
                          and replace(j, strategy=s).lower_bound() <= available), None)
            if stage:
                out.append(f"--strategy {stage}")
        if ZERO.get(j.strategy, 0) < 3:  # fewer replicas: the most ranks that fit
            fit = [n for n in range(j.model_parallel, j.nproc, j.model_parallel)
                   if replace(j, nproc=n).lower_bound() <= available]
            if fit:
                out.append(f"--nproc {fit[-1]}" + (" --strategy single" if fit[-1] == 1 else ""))
    if j.states:
        lean = [o for o in (("--optimizer sgd", replace(j, optimizer="sgd")),
                            ("--optimizer sgd --momentum 0", replace(j, optimizer="sgd", momentum=0.0)))
                if o[1].states < j.states]
        fit = next((flag for flag, k in lean if k.lower_bound() <= available), None)
        if fit:
            out.append(fit)
    if j.dtype != "float32" and replace(j, dtype="float32").lower_bound() <= available:
        out.append("--dtype float32")
    if not out:  # no one change: all of them at once
        flags, lean = [], replace(j, optimizer="sgd", momentum=0.0, dtype="float32")
        if j.strategy in DATA_PARALLEL and j.model_parallel == 1 and j.nproc > 1:
            flags, lean = ["--strategy zero3"], replace(lean, strategy="zero3")
        elif j.strategy not in PS and j.nproc > j.model_parallel:
            flags, lean = [f"--nproc {j.model_parallel}"], replace(lean, nproc=j.model_parallel)
        flags += ["--optimizer sgd --momentum 0"] * bool(j.states) + ["--dtype float32"] * (j.dtype != "float32")
        if len(flags) > 1 and lean.lower_bound() <= available:
            out.append(" ".join(flags))
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def check_memory(cfg, available: float | None, launched: tuple[int, int] | None = None) -> None:
    """ConfigError, one line (the estimate, the memory available, the flags that would fit), when the ranks
    this process spawns cannot hold the model (:meth:`Job.lower_bound`) in ``available`` bytes."""
    from distrain.checkpoint.models import is_hf_name

    if available is None or launched is not None or cfg.device == "cuda" or \
            (cfg.custom_model and not is_hf_name(cfg.model)):
        return
    if cfg.device == "auto":
        import torch

        if torch.cuda.is_available():  # the states live in device memory, not the host's
            return
    j = job(cfg, *count_parameters(cfg))
    need = j.lower_bound()
    if need <= available:
        return
    ways = fixes(j, available)
    how = (f"it would fit with {' or '.join(ways)}, or " if ways else "no flag makes it fit: ") + \
        "train a smaller model"
    raise ConfigError(f"--model {cfg.model} needs at least {gb(need)} of memory ({j.describe()}, no activations) "
                      f"and this host has {gb(available)} available; {how}")
