"""A mixture-of-experts feed-forward layer: a top-k router over SwiGLU experts, with load balancing.

Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer"
(2017); Lepikhin et al., "GShard" (2020); Fedus et al., "Switch Transformers" (2021); Jiang et al.,
"Mixtral of Experts" (2024). For each token x (C,), with E experts and the router's weight Wg (E, C)::

    logits = Wg x                                     (E,)
    p      = softmax(logits)          gating="softmax" (Mixtral)
           = sigmoid(logits)          gating="sigmoid" (DeepSeek-V3; p / sum(p) in the balance loss)
    S      = the k largest p_i;  w_i = p_i / sum_{j in S} p_j (norm_topk, Mixtral's), else p_i
    y      = sum_{i in S} w_i * E_i(x)  [+ shared(x)]     E_i(x) = w2(silu(w1 x) * w3 x)

Load balancing (Switch eq. 4-6, Mixtral's ``router_aux_loss_coef``; Hugging Face's
``load_balancing_loss_func``): over the T tokens of a step,
``aux = coef * E * sum_i f_i * P_i`` with ``f_i`` = (slots routed to expert i) / T (sums to k) and
``P_i`` = mean over the tokens of p_i; balanced routing gives ``coef * k``. It is added to the
gradient, not to the reported loss (Megatron-Core's ``MoEAuxLossAutoScaler``: the layer's output
carries it, and its backward adds d aux), so any loss function trains the balance. ``f`` is
counted over every token of the step -- ``dispatch.token_totals`` sums the counts over the
data-parallel ranks (models/experts.py) -- and each rank's ``aux`` uses its own tokens' mean ``P``,
so the ranks' mean aux is the step's aux exactly, as one process computes it ("global-batch"
balancing, Qiu et al. 2025).

Capacity (GShard, Switch): ``capacity_factor`` c > 0 lets expert i take at most
``ceil(c * N * k / E)`` of a process's N tokens' slots, first choices before second choices, in
token order; a slot over it is dropped (its token keeps the residual and its other slots). The
count of dropped slots is kept (``dropped``, in the trainer's metrics as ``moe_dropped``). c = 0:
no limit, nothing dropped (exact against expert parallelism).

Layout contract: ``gate`` (E, C) as Hugging Face's Mixtral ``mlp.gate``; ``experts`` an
``nn.ModuleDict`` keyed by the expert's global index ("0" .. "E-1": the same state-dict names as a
ModuleList, and an expert-parallel plan keeps the keys of its own experts only); ``dispatch``:
where the experts run (models/experts.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.experts import ALL_HERE

__all__ = ["GATINGS", "MoEConfig", "MoEFeedForward", "SwiGLU", "load_balance_loss", "moe_metrics", "route"]

GATINGS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """The experts of every block. ``expert_size``: each expert's SwiGLU width (None: the model's
    intermediate_size); ``shared_expert_size``: a dense SwiGLU every token also goes through (0: none)."""

    num_experts: int = 4
    top_k: int = 2
    gating: str = "softmax"
    norm_topk: bool = True
    expert_size: int | None = None
    shared_expert_size: int = 0
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # 0: unlimited

    def __post_init__(self):
        for name in ("num_experts", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"moe.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"moe.top_k {self.top_k} exceeds moe.num_experts {self.num_experts}; a token is routed "
                              f"to top_k distinct experts: choose top_k <= {self.num_experts}")
        if self.gating not in GATINGS:
            raise ConfigError(f"moe.gating {self.gating!r} is unknown; use softmax or sigmoid")
        if self.expert_size is not None and (isinstance(self.expert_size, bool) or not isinstance(
                self.expert_size, int) or self.expert_size < 1):
            raise ConfigError(f"moe.expert_size must be a positive int or None, got {self.expert_size!r}")
        if isinstance(self.shared_expert_size, bool) or not isinstance(self.shared_expert_size, int) \
                or self.shared_expert_size < 0:
            raise ConfigError(f"moe.shared_expert_size must be an int >= 0 (0: none), got {self.shared_expert_size!r}")
        for name in ("aux_loss_coef", "capacity_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"moe.{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.norm_topk, bool):
            raise ConfigError(f"moe.norm_topk must be True or False, got {self.norm_topk!r}")

    @classmethod
    def of(cls, value) -> "MoEConfig | None":
        """None, a MoEConfig, or a dict of its fields (a preset's, a config.json's)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"moe must be None, a MoEConfig or a dict of its fields, got {value!r}")
        bad = sorted(set(value) - {f.name for f in fields(cls)})
        if bad:
            raise ConfigError(f"moe has no option(s) {bad}; valid options: {', '.join(f.name for f in fields(cls))}")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)


class SwiGLU(nn.Module):
    """One expert: ``w2(silu(w1 x) * w3 x)``, (M, C) -> (M, F) -> (M, C) (Shazeer 2020)."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)  # gate
        self.w3 = nn.Linear(n_embd, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's decision: logits (N, E) -> (ids (N, k) int64, weights (N, k), p (N, E) the gating
    distribution of the balance loss). Half-precision logits are gated in float32 (as Mixtral's)."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    scores = torch.softmax(z, dim=-1) if cfg.gating == "softmax" else torch.sigmoid(z)   # (N, E)
    top, ids = torch.topk(scores, cfg.top_k, dim=-1)                                      # (N, k) each
    weights = top / top.sum(dim=-1, keepdim=True) if cfg.norm_topk else top
    p = scores if cfg.gating == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return ids, weights, p


def drop_over_capacity(ids: torch.Tensor, num_experts: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, k) -> (ids with the slots over ``capacity`` per expert set to -1, dropped count ()).
    Priority: every token's first choice before any second choice, then token order (GShard)."""
    N, k = ids.shape
    order = ids.t().reshape(-1)                                        # (k*N,) slot-major: first choices first
    onehot = F.one_hot(order, num_experts)                             # (k*N, E)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1                    # (k*N,) its place in its expert's queue
    keep = (place < capacity).view(k, N).t()                           # (N, k)
    return torch.where(keep, ids, torch.full_like(ids, -1)), (~keep).sum()


def load_balance_loss(f: torch.Tensor, p_mean: torch.Tensor, coef: float) -> torch.Tensor:
    """``coef * E * sum_i f_i * P_i`` (Switch eq. 4; f_i: slots routed to i per token, P_i: mean p_i)."""
    return coef * f.numel() * (f.to(p_mean.dtype) * p_mean).sum()


class _AddAuxGradient(torch.autograd.Function):
    """Identity on the layer's output; its backward also starts the aux loss's backward with
    d aux = 1 (Megatron-Core's MoEAuxLossAutoScaler), so the loss gains ``aux`` in its gradient."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.ones_like(aux)


class MoEFeedForward(nn.Module):
    """(B, T, C) -> (B, T, C): the mixture in place of a dense SwiGLU (module docstring)."""

    dispatch = ALL_HERE  # where the experts run (models/experts.py); an expert-parallel plan sets its own
    # Under tensor parallelism every rank keeps the whole mixture and runs it on the replicated
    # activations (the same tokens on every tp rank): no tp messages, identical gradients on the tp
    # ranks; its experts split by expert parallelism instead (parallel/tensor_parallel/plan.py).
    tp_replicated = True

    def __init__(self, n_embd: int, intermediate_size: int, cfg: MoEConfig):
        super().__init__()
        self.moe = cfg
        width = cfg.expert_size or intermediate_size
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(n_embd, cfg.num_experts, bias=False)                       # router, (E, C)
        self.experts = nn.ModuleDict({str(e): SwiGLU(n_embd, width) for e in range(cfg.num_experts)})
        if cfg.shared_expert_size:
            self.shared_expert = SwiGLU(n_embd, cfg.shared_expert_size)
        self.dropped = 0  # slots dropped over capacity in the last training forward (every rank's tokens)
        self.routed = 0   # slots routed in it (tokens x k)
        self.aux_loss: torch.Tensor | None = None  # this rank's aux of the last training forward (detached)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)                                                      # (N, C)
        ids, weights, p = route(self.gate(flat), self.moe)                              # (N, k), (N, k), (N, E)
        chosen = ids
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.moe.capacity_factor > 0:
            cap = math.ceil(self.moe.capacity_factor * B * T * self.moe.top_k / self.num_experts)
            ids, dropped = drop_over_capacity(ids, self.num_experts, cap)
        experts = {int(e): m for e, m in self.experts.items()}
        y = self.dispatch.combine(flat, ids, weights.to(x.dtype), experts)              # (N, C)
        if hasattr(self, "shared_expert"):
            y = y + self.shared_expert(flat)
        if self.training and torch.is_grad_enabled():
            # f over every token of the step: the counts (and the drop tally) summed over the data ranks
            counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).double()   # (E,)
            tally = torch.tensor([float(dropped), float(B * T)], dtype=torch.float64, device=x.device)
            stats = self.dispatch.token_totals(torch.cat([counts, tally]))                   # (E + 2,)
            tokens = stats[-1]
            self.dropped, self.routed = int(stats[-2]), int(tokens) * self.moe.top_k
            if self.moe.aux_loss_coef > 0:
                aux = load_balance_loss(stats[:-2] / tokens, p.mean(dim=0), self.moe.aux_loss_coef)
                self.aux_loss = aux.detach()
                y = _AddAuxGradient.apply(y, aux)
        return y.view(B, T, C)


def moe_metrics(model: nn.Module) -> dict:
    """{"moe_dropped": slots dropped over capacity, "moe_routed": slots routed} summed over the
    mixture layers of ``model`` in their last training forward; {} for a model without one."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        return {}
    return {"moe_dropped": sum(m.dropped for m in layers), "moe_routed": sum(m.routed for m in layers)}
