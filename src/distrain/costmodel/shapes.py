"""Transformer shapes for the planner: parameter counts and model FLOPs from the sizes alone.

A :class:`Shape` is what a decoder-only transformer's cost depends on: layers L, hidden size h,
query heads a and key/value heads g (grouped-query attention, Ainslie et al. 2023), head size
d (h / a unless given), MLP width f (per expert for a mixture of experts), vocabulary V, a gated
MLP (SwiGLU: three h x f matrices, Shazeer 2020) or not (GELU: two), biases and LayerNorm (GPT)
or neither and RMSNorm (Llama), learned positions or rotary ones, a tied output head, and E
experts of which each token uses k (Shazeer et al. 2017; Fedus et al. 2021).

Model FLOPs per token (:meth:`Shape.model_flops_per_token`) follow Megatron-LM's count
(megatron/training/training.py ``num_floating_point_operations``, the formula of Narayanan et
al., SC 2021, eq. 3, generalised to GQA, SwiGLU and MoE): 6 FLOPs per matmul weight a token
passes through (forward 2, backward 4), the attention scores and their product with V counted
over the full s x s square (12·L·a·d·s), and the output head (6·h·V). It is the numerator of
MFU; the time model (:mod:`distrain.costmodel.kernels`) counts what kernels execute instead
(causal attention skips half the square, recomputation adds a forward).

Presets: distrain's GPT and Llama presets (sizes read from ``models/registry.py`` without
building a model) and published shapes (:data:`PUBLISHED`, each with its source).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from distrain.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = True
    bias: bool = False
    tied: bool = False
    positions: int = 0  # learned position-embedding rows (GPT, MPT); 0 for rotary positions
    experts: int = 0  # MoE: experts per layer (0: a dense MLP)
    top_k: int = 0  # MoE: experts each token is routed to
    head_dim: int = 0  # 0: hidden // heads
    source: str = field(default="", compare=False)

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model shape {self.name!r}: {name} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model shape {self.name!r}: {self.heads} query heads do not divide into "
                              f"{self.kv_heads} key/value heads; give --kv-heads a divisor of --heads")
        if not self.head_dim and self.hidden % self.heads:
            raise ConfigError(f"model shape {self.name!r}: hidden {self.hidden} is not a multiple of {self.heads} "
                              f"heads; give --head-dim or a hidden size divisible by --heads")
        if bool(self.experts) != bool(self.top_k) or self.top_k > self.experts:
            raise ConfigError(f"model shape {self.name!r}: a mixture of experts needs 1 <= --top-k <= --experts, "
                              f"got experts={self.experts}, top_k={self.top_k}")

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    # -- parameters -------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.d, self.kv_heads * self.d
        return h * (q + 2 * kv) + q * h + (q + 2 * kv + h if self.bias else 0)

    def mlp_params(self) -> int:
        """One MLP (one expert of a MoE layer)."""
        h, f = self.hidden, self.ffn
        mats = 3 if self.gated else 2
        return mats * h * f + ((2 if self.gated else 1) * f + h if self.bias else 0)

    def norm_params(self) -> int:
        return self.hidden * (2 if self.bias else 1)

    def layer_params(self) -> int:
        """One block: attention, its MLP(s) (and the router), two norms."""
        mlp = self.experts * self.mlp_params() + self.hidden * self.experts if self.moe else self.mlp_params()
        return self.attention_params() + mlp + 2 * self.norm_params()

    def expert_params_per_layer(self) -> int:
        return self.experts * self.mlp_params() if self.moe else 0

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        """The final norm and, when untied, the output matrix."""
        return self.norm_params() + (0 if self.tied else self.vocab * self.hidden)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through: every block's attention and k experts' MLPs
        (or the dense MLP) and the output head; embeddings are a lookup, not a matmul."""
        h, q, kv = self.hidden, self.heads * self.d, self.kv_heads * self.d
        attn = h * (q + 2 * kv) + q * h
        mlp = (3 if self.gated else 2) * h * self.ffn * (self.top_k if self.moe else 1)
        return self.layers * (attn + mlp) + self.vocab * h

    def model_flops_per_token(self, seq: int) -> float:
        """Megatron-LM's training FLOPs per token (no recomputation): 6 per active matmul
        weight plus 12·L·a·d·s for attention (the full square)."""
        return 6.0 * self.active_matmul_params() + 12.0 * self.layers * self.heads * self.d * seq

    def tensor_sizes(self) -> list[int]:
        """Elements of every parameter tensor in the order of distrain's GPT / Llama modules
        (``model.parameters()``: embeddings, each block's norm and attention, norm and MLP, the
        head), for DDP's buckets without building the model. A mixture (Llama only): the router (E x h),
        then each expert's w1, w3, w2."""
        h, q, kv, f = self.hidden, self.heads * self.d, self.kv_heads * self.d, self.ffn
        if self.moe and self.bias:
            raise ConfigError(f"{self.name}: tensor_sizes() lists Llama mixtures of experts only (no biases)")
        out = [self.vocab * h] + ([self.positions * h] if self.positions else [])
        for _ in range(self.layers):
            if self.bias:  # GPT: ln_1 (w, b), q, k, v, o (w, b each), ln_2 (w, b), fc (w, b), proj (w, b)
                out += [h, h, q * h, q, kv * h, kv, kv * h, kv, h * q, h, h, h, f * h, f, h * f, h]
            else:  # Llama: attention_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2 (a mixture: gate, then per expert)
                mlp = [self.experts * h] + [f * h, f * h, h * f] * self.experts if self.moe else [f * h, f * h, h * f]
                out += [h, q * h, kv * h, kv * h, h * q, h] + mlp
        out += [h, h] if self.bias else [h]
        return out + ([] if self.tied else [self.vocab * h])

    def describe(self) -> str:
        moe = f", {self.experts} experts top-{self.top_k}" if self.moe else ""
        n = self.params()
        count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"
        return (f"{self.name}: {count} parameters, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads}/{self.kv_heads} heads, ffn {self.ffn}{moe}, vocab {self.vocab}")


def _gpt(name, layers, hidden, heads, vocab, positions, source, tied=False):
    return Shape(name, layers, hidden, heads, heads, 4 * hidden, vocab, gated=False, bias=True, tied=tied,
                 positions=positions, source=source)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, tied=False, source=""):
    return Shape(name, layers, hidden, heads, kv, ffn, vocab, gated=True, bias=False, tied=tied, source=source)


_MPT = "MosaicML llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_heads, n_layers, expansion 4, vocab 50368)"
# published shapes beyond distrain's presets (the sizes of each model's config)
PUBLISHED: dict[str, Shape] = {
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256,
                          source="Meta, The Llama 3 Herd of Models (2024), Table 3"),
    "llama-3.1-405b": _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256,
                             source="Meta, The Llama 3 Herd of Models (2024), Table 3"),
    # MPT as benchmarked in llm-foundry's scripts/train/benchmarking/README.md: GELU MLP (4h), biases and learned
    # positions (its NumParams column = 12h^2 + 13h per layer + (vocab + seq) x h + final norm), tied head
    **{f"mpt-{n}": _gpt(f"mpt-{n}", L, h, a, 50368, 2048, _MPT, tied=True)
       for n, L, h, a in (("125m", 12, 768, 12), ("350m", 24, 1024, 16), ("760m", 24, 1536, 12), ("1b", 24, 2048, 16),
                          ("3b", 32, 2560, 20), ("7b", 32, 4096, 32), ("13b", 40, 5120, 40), ("30b", 48, 7168, 56),
                          ("70b", 80, 8192, 64))},
}


def preset_shape(name: str) -> Shape:
    """A distrain GPT/Llama preset (registry sizes) or a :data:`PUBLISHED` shape."""
    if name in PUBLISHED:
        return PUBLISHED[name]
    from distrain.models.registry import MODEL_PRESETS

    if name not in MODEL_PRESETS or MODEL_PRESETS[name][0] not in ("gpt", "llama"):
        known = sorted(n for n, (k, _) in MODEL_PRESETS.items() if k in ("gpt", "llama")) + sorted(PUBLISHED)
        raise ConfigError(f"--model {name!r}: no transformer shape of that name; choose from {', '.join(known)} or "
                          f"give the shape (--layers, --hidden, --heads, --ffn, --vocab)")
    kind, kw = MODEL_PRESETS[name]
    if kind == "gpt":
        return _gpt(name, kw["n_layer"], kw["n_embd"], kw["n_head"], kw["vocab_size"], kw["block_size"],
                    "models/registry.py")
    from distrain.models.llama.model import swiglu_hidden

    ffn = kw.get("intermediate_size") or swiglu_hidden(kw["n_embd"])
    shape = _llama(name, kw["n_layer"], kw["n_embd"], kw["n_head"], kw.get("n_kv_head") or kw["n_head"], ffn,
                   kw["vocab_size"], tied=bool(kw.get("tie_word_embeddings", False)), source="models/registry.py")
    moe = kw.get("moe")  # a mixture of experts (models/moe.py): E experts of width expert_size, top-k; no shared one
    if moe and not moe.get("shared_expert_size"):
        shape = replace(shape, ffn=moe.get("expert_size") or ffn, experts=moe["num_experts"], top_k=moe["top_k"])
    elif moe:
        raise ConfigError(f"--model {name!r}: a shared expert is not in the planner's MoE shape; give the shape "
                          f"(--experts, --top-k, ...)")
    return shape


def with_positions(shape: Shape, seq: int) -> Shape:
    """A learned-position shape holds one row per position of the trained sequence length."""
    return replace(shape, positions=seq) if shape.positions else shape
