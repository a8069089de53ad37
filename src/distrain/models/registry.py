"""Model presets and ``build_model(name, **overrides)``.

Parameter counts (from :func:`count_parameters`):

* ``gpt-tiny``  (block 16, 4 layers, 4 heads, C=32, V=256):      67,776
* ``gpt-small`` (block 64, 4 layers, 4 heads, C=128, V=256):    867,072
  (85-115 ms for forward+backward of a (32, 64) batch on 2 shared CPU cores, fp32)
* ``mlp``       (784 -> 1536 -> 1536 -> 768 -> 10):         4,754,698
* ``mlp-tiny``  (64 -> 64 -> 32 -> 10, for 8x8 digits):          6,570
* ``llama-tiny``  (block 32, 2 layers, 4 heads / 2 KV heads, C=64, F=192, V=256):   131,392
* ``llama-small`` (block 64, 4 layers, 4 heads / 2 KV heads, C=128, F=384, V=256):  853,120
* ``llama-moe-tiny`` (llama-tiny's attention, 4 SwiGLU experts of F=128, top-2, C=64, V=256): 254,784
* shape-only (published sizes; build them on the meta device): ``smollm2-135m`` (134,515,008),
  ``llama-3.2-1b`` (1,235,814,400), ``llama-3-8b`` (8,030,261,248), ``mixtral-8x7b`` (46,702,792,704)
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch.nn as nn

from distrain.errors import ConfigError
from distrain.models.gpt import GPT, GPTConfig
from distrain.models.llama.model import Llama, LlamaConfig
from distrain.models.mlp import MLP

DEFAULT_MODEL = "gpt-small"  # what a run trains when --model is left out

# name -> (kind, keyword arguments)
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-tiny": ("gpt", dict(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=32)),
    "gpt-small": ("gpt", dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)),
    "mlp": ("mlp", dict(in_features=784, hidden=(1536, 1536, 768), num_classes=10)),
    "mlp-tiny": ("mlp", dict(in_features=64, hidden=(64, 32), num_classes=10)),
    "llama-tiny": ("llama", dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                 intermediate_size=192)),
    "llama-small": ("llama", dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                                  intermediate_size=384)),
    # a mixture of experts (models/moe.py): 4 SwiGLU experts of width 128 per block, top-2, softmax gating
    "llama-moe-tiny": ("llama", dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                     intermediate_size=128, moe=dict(num_experts=4, top_k=2, gating="softmax",
                                                                     aux_loss_coef=0.01, capacity_factor=0.0))),
    # published sizes (HF config.json of each); block_size: the pretraining context
    "smollm2-135m": ("llama", dict(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                                   intermediate_size=1536, rope_theta=100000.0, tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, block_size=8192, n_layer=16, n_head=32, n_kv_head=8,
                                   n_embd=2048, intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True,
                                   rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=8192))),
    "llama-3-8b": ("llama", dict(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                 intermediate_size=14336, rope_theta=500000.0)),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336, top-2 (46.7B parameters, 12.9B active per token)
    "mixtral-8x7b": ("llama", dict(vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                   intermediate_size=14336, rope_theta=1000000.0,
                                   moe=dict(num_experts=8, top_k=2, gating="softmax", aux_loss_coef=0.02))),
}
# presets with published sizes only: too big to measure or train here (distrain plan needs --compute-ms)
SHAPE_ONLY_PRESETS = frozenset({"smollm2-135m", "llama-3.2-1b", "llama-3-8b", "mixtral-8x7b"})

_VALID_KEYS: dict[str, list[str]] = {
    "gpt": GPTConfig.field_names(),
    "mlp": ["in_features", "hidden", "num_classes"],
    "llama": LlamaConfig.field_names(),
}
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "gpt": lambda **kw: GPT(GPTConfig(**kw)),
    "mlp": lambda **kw: MLP(**kw),
    "llama": lambda **kw: Llama(LlamaConfig(**kw)),
}


def list_models() -> list[str]:
    return sorted(MODEL_PRESETS)


def model_kind(name: str) -> str:
    """``"gpt"`` or ``"mlp"``."""
    return _lookup(name)[0]


def preset_config(name: str, **overrides) -> dict[str, Any]:
    """The keyword arguments ``build_model(name, **overrides)`` would use."""
    kind, base = _lookup(name)
    bad = sorted(set(overrides) - set(_VALID_KEYS[kind]))
    if bad:
        raise ConfigError(
            f"model {name!r} has no option(s) {bad}; valid options: {', '.join(_VALID_KEYS[kind])}"
        )
    cfg = copy.deepcopy(base)
    cfg.update(overrides)
    return cfg


def build_model(name: str, **overrides) -> nn.Module:
    """Build a preset, e.g. ``build_model("gpt-small", n_layer=8)``. Call
    ``torch.manual_seed`` first for a reproducible init."""
    kind = model_kind(name)
    return _BUILDERS[kind](**preset_config(name, **overrides))


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of (unique) parameter elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _lookup(name: str) -> tuple[str, dict[str, Any]]:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(list_models())}")
    return MODEL_PRESETS[name]


def tp_plan_for(model: nn.Module):
    """The tensor-parallel plan kept beside ``model``'s class (GPT: Megatron's; MLP: column/row
    pairs; a Hugging Face Llama-family decoder or its ``pipeline_layers`` wrapper: distrain's
    ``models.hf_transformers.hf_tp_plan``, HF's own ``tp_plan`` ignored; another HF model: its ``tp_plan``
    translated where every style maps exactly), or ``None`` for a model that brings none (pass
    ``tp_plan=`` yourself)."""
    from distrain.models.gpt.plan import gpt_tp_plan
    from distrain.models.hf_transformers.plan import hf_tp_plan_for
    from distrain.models.llama.plan import llama_tp_plan
    from distrain.models.mlp.plan import mlp_tp_plan

    if isinstance(model, GPT):
        return gpt_tp_plan()
    if isinstance(model, MLP):
        return mlp_tp_plan(model)
    if isinstance(model, Llama):
        return llama_tp_plan()
    return hf_tp_plan_for(model)


def model_tp_plan(model: nn.Module):
    """The plan the trainer applies: the model's own ``tp_plan`` attribute (a TPPlan, or a mapping
    of distrain's styles), else :func:`tp_plan_for`. A Hugging Face model's ``tp_plan`` is HF's
    (HF's styles), never taken as distrain's: :func:`tp_plan_for` decides for it."""
    from distrain.models.hf_transformers.plan import is_hf_model

    own = None if is_hf_model(model) else getattr(model, "tp_plan", None)
    return own or tp_plan_for(model)


def model_cp_plan(model: nn.Module):
    """The context-parallel plan the trainer applies: the model's own ``cp_plan`` attribute (a
    ``distrain.parallel.context_parallel.CPPlan``), else the one beside its class (the GPT's, the
    Llama's), else None (the model cannot be split along the sequence)."""
    own = getattr(model, "cp_plan", None)
    if own is not None:
        return own
    if isinstance(model, GPT):
        from distrain.models.gpt.plan import gpt_cp_plan

        return gpt_cp_plan()
    if isinstance(model, Llama):
        from distrain.models.llama.plan import llama_cp_plan

        return llama_cp_plan()
    return None


def model_ep_plan(model: nn.Module):
    """The expert-parallel plan the trainer applies: the model's own ``ep_plan`` attribute (a
    ``distrain.parallel.expert_parallel.EPPlan``), else the Llama's when it has experts, else None."""
    own = getattr(model, "ep_plan", None)
    if own is not None:
        return own
    if isinstance(model, Llama) and model.config.moe is not None:
        from distrain.models.llama.plan import llama_ep_plan

        return llama_ep_plan()
    return None


def num_experts_of(model: nn.Module) -> int | None:
    """Experts per mixture layer of ``model`` (its config's ``moe``), None for a model without experts."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    return getattr(moe, "num_experts", None)


def check_ep_fits(model: nn.Module, ep: int, data_ranks: int) -> None:
    """``distrain.train(model=..., config=TrainConfig(ep=N))`` in the caller, before any rank starts: an
    expert-parallel plan that names mixture layers, and ep dividing their experts and dp x cp; each a
    one-line ConfigError."""
    from distrain.parallel.expert_parallel import check_ep_sizes

    plan = model_ep_plan(model)
    layers = plan.layers(model) if plan is not None else []
    check_ep_sizes(ep, layers[0][1].num_experts if layers else None, data_ranks, type(model).__name__)


def check_cp_fits(model: nn.Module, cp: int, variant: str, tp: int = 1) -> None:
    """``distrain.train(model=..., config=TrainConfig(cp=N))`` in the caller, before any rank starts:
    a context-parallel plan (:func:`model_cp_plan`), 2 x cp dividing ``model.config.block_size`` (the
    trainer's sequence length), and the plan's own check (the all-to-all's heads, ``tp`` still to
    divide them); each a one-line ConfigError."""
    from distrain.parallel.context_parallel import check_length

    plan = model_cp_plan(model)
    if plan is None:
        raise ConfigError(f"--cp {cp}: {type(model).__name__} has no context-parallel plan (distrain's GPT and Llama "
                          f"have one); give your model a `cp_plan` (distrain.parallel.context_parallel.CPPlan naming "
                          f"the modules that read `self.sequence`, see distrain.models.sequence) or use --cp 1")
    block = getattr(getattr(model, "config", None), "block_size", None)
    if block is not None:
        check_length(block, cp, f"{type(model).__name__}'s sequence (block_size)")
    if plan.check is not None:
        plan.check(model, cp, variant, **({"tp": tp} if tp > 1 else {}))
