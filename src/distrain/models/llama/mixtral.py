"""Hugging Face's Mixtral <-> distrain's Llama with ``moe``: the mixture's config fields and tensors.

Mixtral (Jiang et al. 2024; transformers' ``MixtralForCausalLM``) is a Llama whose MLP is a
mixture: a router ``gate`` (E, C), softmax over E, the top ``num_experts_per_tok`` renormalized, E
SwiGLU experts of width ``intermediate_size``. Its attention, norms, embedding and head are the
Llama's (hf.py maps them); this module maps the rest. Names (HF layer i is our ``layers.{i+1}``)::

    transformers 5 (in memory, and what to_hf writes):
    model.layers.{i}.mlp.gate.weight                 (E, C)      feed_forward.gate.weight
    model.layers.{i}.mlp.experts.gate_up_proj        (E, 2F, C)  feed_forward.experts.{e}.w1.weight = [e, :F]
                                                                 feed_forward.experts.{e}.w3.weight = [e, F:]
    model.layers.{i}.mlp.experts.down_proj           (E, C, F)   feed_forward.experts.{e}.w2.weight = [e]
    the published checkpoints (mistralai/Mixtral-8x7B-v0.1, transformers 4), read too:
    model.layers.{i}.block_sparse_moe.gate.weight                feed_forward.gate.weight
    model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight  feed_forward.experts.{e}.w1/w3/w2.weight

Importing cuts the fused tensors into views (no copy); exporting stacks the experts (a copy). What
Mixtral's layout has no place for is refused by :func:`check_exportable` (sigmoid gating, top-k
weights not renormalized, a shared expert, experts narrower than ``intermediate_size``); the
capacity factor is training's and is not exported (transformers' Mixtral drops nothing).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from distrain.errors import ConfigError
from distrain.models.moe import MoEConfig

__all__ = ["check_exportable", "experts_from_hf", "experts_to_hf", "moe_config_from_hf", "moe_config_to_hf",
           "moe_shapes"]

_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")
_HUB = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)")


def moe_config_from_hf(c: Mapping[str, Any]) -> MoEConfig:
    """The mixture of a Mixtral config dict (``num_local_experts``, ``num_experts_per_tok``,
    ``router_aux_loss_coef``); a sliding window shorter than the context is refused (the Llama's
    attention is full)."""
    window, context = c.get("sliding_window"), c.get("max_position_embeddings")
    if window is not None and (context is None or window < context):
        raise ConfigError(f"from_hf: Mixtral sliding_window={window} (< max_position_embeddings={context}) is not "
                          f"supported; distrain's Llama attends to the whole context: set sliding_window to null")
    if float(c.get("router_jitter_noise") or 0.0):
        raise ConfigError(f"from_hf: Mixtral router_jitter_noise={c['router_jitter_noise']} is not supported; set it "
                          f"to 0")
    return MoEConfig(num_experts=int(c.get("num_local_experts", 8)), top_k=int(c.get("num_experts_per_tok", 2)),
                     gating="softmax", norm_topk=True, aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))


def check_exportable(moe: MoEConfig, intermediate_size: int) -> None:
    """What Mixtral cannot hold: a one-line ConfigError naming it."""
    bad = [f"{k}={getattr(moe, k)!r} (Mixtral: {ok!r})" for k, ok in (("gating", "softmax"), ("norm_topk", True),
                                                                       ("shared_expert_size", 0))
           if getattr(moe, k) != ok]
    if moe.expert_size not in (None, intermediate_size):
        bad.append(f"expert_size={moe.expert_size} (Mixtral: intermediate_size={intermediate_size})")
    if bad:
        raise ConfigError(f"to_hf: the Mixtral layout has no place for moe {', '.join(bad)}")


def moe_config_to_hf(moe: MoEConfig) -> dict[str, Any]:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef, "sliding_window": None,
            "router_jitter_noise": 0.0, "output_router_logits": False}


def moe_shapes(prefix: str, C: int, F: int, moe: MoEConfig) -> dict[str, tuple[int, ...]]:
    """{our name: shape} of one block's mixture (``prefix``: "layers.{i}.")."""
    width = moe.expert_size or F
    out = {prefix + "feed_forward.gate.weight": (moe.num_experts, C)}
    for e in range(moe.num_experts):
        p = f"{prefix}feed_forward.experts.{e}."
        out.update({p + "w1.weight": (width, C), p + "w3.weight": (width, C), p + "w2.weight": (C, width)})
    if moe.shared_expert_size:
        p, S = prefix + "feed_forward.shared_expert.", moe.shared_expert_size
        out.update({p + "w1.weight": (S, C), p + "w3.weight": (S, C), p + "w2.weight": (C, S)})
    return out


def experts_from_hf(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(our mixture tensors, the rest of ``state_dict``): either layout of the module docstring."""
    ours, rest = {}, {}
    for name, t in state_dict.items():
        fused, hub = _FUSED.fullmatch(name), _HUB.fullmatch(name)
        if fused:
            p, what = f"layers.{int(fused.group(1)) + 1}.feed_forward.", fused.group(2)
            if what == "gate.weight":
                ours[p + "gate.weight"] = t
            elif what == "experts.gate_up_proj":                                  # (E, 2F, C)
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    ours[f"{p}experts.{e}.w1.weight"], ours[f"{p}experts.{e}.w3.weight"] = t[e, :half], t[e, half:]
            else:                                                                 # down_proj (E, C, F)
                for e in range(t.shape[0]):
                    ours[f"{p}experts.{e}.w2.weight"] = t[e]
        elif hub:
            p = f"layers.{int(hub.group(1)) + 1}.feed_forward."
            ours[p + ("gate.weight" if hub.group(2) == "gate.weight" else f"experts.{hub.group(3)}.{hub.group(4)}"
                      ".weight")] = t
        else:
            rest[name] = t
    return ours, rest


def experts_to_hf(state_dict: Mapping[str, torch.Tensor], n_layer: int, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """Our mixture tensors -> transformers 5's Mixtral names (experts stacked: gate_up_proj, down_proj)."""
    out = {}
    for i in range(1, n_layer + 1):
        p, hf = f"layers.{i}.feed_forward.", f"model.layers.{i - 1}.mlp."
        out[hf + "gate.weight"] = state_dict[p + "gate.weight"]
        E = range(moe.num_experts)
        out[hf + "experts.gate_up_proj"] = torch.stack([torch.cat([state_dict[f"{p}experts.{e}.w{w}.weight"]
                                                                   for w in (1, 3)]) for e in E])  # (E, 2F, C)
        out[hf + "experts.down_proj"] = torch.stack([state_dict[f"{p}experts.{e}.w2.weight"] for e in E])
    return out
