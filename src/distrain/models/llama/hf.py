"""Hugging Face <-> distrain Llama state dicts and configs: pure functions, no file I/O.

    cfg, sd = from_hf(hf_state_dict, hf_config_dict)   # e.g. LlamaForCausalLM.state_dict(), config.to_dict()
    model = Llama(cfg); model.load_state_dict(sd)       # strict
    hf_sd, hf_cfg = to_hf(model.state_dict(), model.config)

Names (HF layer i is our ``layers.{i+1}``: our layers[0] is the embedding, layers[-1] the head)::

    model.embed_tokens.weight                       layers.0.tok_embeddings.weight
    model.layers.{i}.input_layernorm.weight          layers.{i+1}.attention_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i+1}.attention.{wq,wk,wv,wo}.weight
    model.layers.{i}.post_attention_layernorm.weight layers.{i+1}.ffn_norm.weight
    model.layers.{i}.mlp.gate_proj.weight            layers.{i+1}.feed_forward.w1.weight
    model.layers.{i}.mlp.up_proj.weight              layers.{i+1}.feed_forward.w3.weight
    model.layers.{i}.mlp.down_proj.weight            layers.{i+1}.feed_forward.w2.weight
    model.norm.weight                               layers.{n+1}.norm.weight
    lm_head.weight                                  layers.{n+1}.output.weight (untied only)

Rotary layout: our attention rotates channel i with channel i + head_dim/2 (HF's rotate_half),
so wq/wk are copied as they are. (torchtitan's adapter permutes wq/wk rows because its model,
like Meta's original checkpoints, rotates the interleaved pairs (2i, 2i+1).) Tensors are not
copied either way: the returned dicts hold the same tensors.

Tied embeddings: HF's ``state_dict()`` lists ``lm_head.weight`` (the embedding itself);
``from_hf`` accepts it present (and equal to the embedding) or absent, and ``to_hf`` lists it
(the same tensor), so ``load_state_dict(strict=True)`` works. ``safetensors.torch.save_file``
refuses tensors that share memory: drop ``lm_head.weight`` before saving (HF re-ties on load).

Mixtral (``model_type`` "mixtral", ``MixtralForCausalLM``): a Llama with ``moe``; its router and
experts are mapped by :mod:`.mixtral` (transformers 5's fused ``mlp.experts.gate_up_proj`` /
``down_proj``, and the published per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3`` on import).

Config: ``rope_theta`` and the llama3 scaling are read from transformers 5's ``rope_parameters``
or from the older top-level ``rope_theta`` / ``rope_scaling``; ``to_hf`` writes both forms.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from distrain.errors import ConfigError
from distrain.models.llama import mixtral
from distrain.models.llama.model import LlamaConfig
from distrain.models.llama.rope import LLAMA3_KEYS

__all__ = ["config_from_hf", "config_to_hf", "from_hf", "state_dict_shapes", "to_hf"]

# HF name inside model.layers.{i} -> ours inside layers.{i+1}
_BLOCK = {"input_layernorm.weight": "attention_norm.weight",
          "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
          "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "feed_forward.w1.weight",
          "mlp.up_proj.weight": "feed_forward.w3.weight", "mlp.down_proj.weight": "feed_forward.w2.weight"}
# which config fields each shape comes from (named in shape errors)
_WHY = {"tok_embeddings": "vocab_size x hidden_size", "output": "vocab_size x hidden_size",
        "norm": "hidden_size", "wq": "num_attention_heads*head_dim x hidden_size",
        "wk": "num_key_value_heads*head_dim x hidden_size", "wv": "num_key_value_heads*head_dim x hidden_size",
        "wo": "hidden_size x num_attention_heads*head_dim", "w1": "intermediate_size x hidden_size",
        "w3": "intermediate_size x hidden_size", "w2": "hidden_size x intermediate_size"}
_ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # old checkpoints saved it; recomputed from the config


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

def config_from_hf(hf_config: Mapping[str, Any] | Any) -> LlamaConfig:
    """Our LlamaConfig from an HF ``LlamaConfig`` (its ``to_dict()``, a config.json dict, or the object)."""
    c = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
    if c.get("model_type", "llama") not in ("llama", "mixtral"):
        raise ConfigError(f"from_hf: model_type {c['model_type']!r} is not 'llama' or 'mixtral'; this adapter reads "
                          f"Llama-family checkpoints (LlamaForCausalLM, MixtralForCausalLM)")
    need = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in need if c.get(k) is None]
    if missing:
        raise ConfigError(f"from_hf: the HF config lacks {missing}; pass the model's whole config (config.to_dict())")
    unsupported = [f"{k}={c[k]!r} (must be {ok!r})" for k, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                                                   ("mlp_bias", False)) if c.get(k, ok) != ok]
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    if c.get("head_dim") not in (None, hidden // heads):
        unsupported.append(f"head_dim={c['head_dim']} (must be hidden_size/num_attention_heads = {hidden // heads})")
    if unsupported:
        raise ConfigError(f"from_hf: unsupported HF config: {', '.join(unsupported)}")
    rope = dict(c.get("rope_parameters") or {})
    legacy = dict(c.get("rope_scaling") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind not in ("default", "llama3"):
        raise ConfigError(f"from_hf: rope_type {kind!r} is not supported; only 'default' and 'llama3'")
    scaling = None
    if kind == "llama3":
        src = rope if rope.get("rope_type") == "llama3" else legacy
        scaling = {k: src.get(k) for k in LLAMA3_KEYS}
    return LlamaConfig(vocab_size=c["vocab_size"], block_size=c.get("max_position_embeddings") or 2048,
                       n_layer=c["num_hidden_layers"], n_head=heads,
                       n_kv_head=c.get("num_key_value_heads") or heads, n_embd=hidden,
                       intermediate_size=c["intermediate_size"], norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(theta), rope_scaling=scaling,
                       tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                       moe=mixtral.moe_config_from_hf(c) if c.get("model_type") == "mixtral" else None)


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """The HF ``LlamaConfig`` fields (a config.json dict): ``LlamaConfig(**d)`` in transformers 4 or 5."""
    scaling = dict(cfg.rope_scaling, rope_type="llama3") if cfg.rope_scaling else None
    if cfg.moe is not None:
        mixtral.check_exportable(cfg.moe, cfg.intermediate_size)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta),
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            **(mixtral.moe_config_to_hf(cfg.moe) if cfg.moe is not None else {})}


# ---------------------------------------------------------------------------------------------
# State dicts
# ---------------------------------------------------------------------------------------------

def state_dict_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """{our parameter name: shape} of ``Llama(cfg).state_dict()``, computed without building it."""
    C, hd, L = cfg.n_embd, cfg.head_dim, cfg.n_layer
    out = {"layers.0.tok_embeddings.weight": (cfg.vocab_size, C)}
    for i in range(1, L + 1):
        p = f"layers.{i}."
        out.update({p + "attention_norm.weight": (C,), p + "attention.wq.weight": (cfg.n_head * hd, C),
                    p + "attention.wk.weight": (cfg.n_kv_head * hd, C),
                    p + "attention.wv.weight": (cfg.n_kv_head * hd, C),
                    p + "attention.wo.weight": (C, cfg.n_head * hd), p + "ffn_norm.weight": (C,)})
        if cfg.moe is not None:
            out.update(mixtral.moe_shapes(p, C, cfg.intermediate_size, cfg.moe))
            continue
        out.update({p + "feed_forward.w1.weight": (cfg.intermediate_size, C),
                    p + "feed_forward.w3.weight": (cfg.intermediate_size, C),
                    p + "feed_forward.w2.weight": (C, cfg.intermediate_size)})
    out[f"layers.{L + 1}.norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        out[f"layers.{L + 1}.output.weight"] = (cfg.vocab_size, C)
    return out


def _hf_name(ours: str, L: int) -> str:
    """Our parameter name -> HF's (for messages and to_hf)."""
    if ours == "layers.0.tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if ours == f"layers.{L + 1}.norm.weight":
        return "model.norm.weight"
    if ours == f"layers.{L + 1}.output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    back = {v: k for k, v in _BLOCK.items()}
    if m and m.group(2) in back and 1 <= int(m.group(1)) <= L:
        return f"model.layers.{int(m.group(1)) - 1}.{back[m.group(2)]}"
    return ours if ".feed_forward." in ours else ""  # a mixture's tensors (stacked by mixtral.experts_to_hf)


def _our_name(hf: str, L: int) -> str:
    """HF parameter name -> ours ('' when it is not a Llama parameter of this depth)."""
    if hf == "model.embed_tokens.weight":
        return "layers.0.tok_embeddings.weight"
    if hf == "model.norm.weight":
        return f"layers.{L + 1}.norm.weight"
    if hf == "lm_head.weight":
        return f"layers.{L + 1}.output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m and m.group(2) in _BLOCK and int(m.group(1)) < L:
        return f"layers.{int(m.group(1)) + 1}.{_BLOCK[m.group(2)]}"
    return ""


def _check_shapes(sd: Mapping[str, torch.Tensor], want: dict[str, tuple], name_of, where: str, cfg_note: str) -> None:
    missing = [n for n in want if n not in sd]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{where}: missing tensor {name_of(missing[0])!r}{more}, shape {want[missing[0]]}; "
                          f"{cfg_note}: pass the whole state dict of a model with this config")
    for n, shape in want.items():
        got = tuple(sd[n].shape)
        if got != shape:
            part = n.split(".")[-2]
            raise ConfigError(f"{where}: tensor {name_of(n)!r} has shape {got}, but the config needs {shape} "
                              f"({_WHY.get(part, '')}; {cfg_note}); fix the config to match the checkpoint")


def _note(cfg: LlamaConfig) -> str:
    return (f"config: vocab_size={cfg.vocab_size}, hidden_size={cfg.n_embd}, num_hidden_layers={cfg.n_layer}, "
            f"num_attention_heads={cfg.n_head}, num_key_value_heads={cfg.n_kv_head}, head_dim={cfg.head_dim}, "
            f"intermediate_size={cfg.intermediate_size}, tie_word_embeddings={cfg.tie_word_embeddings}")


def from_hf(state_dict: Mapping[str, torch.Tensor], hf_config) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(our config, our state dict) from an HF ``LlamaForCausalLM`` state dict and its config.
    Raises ConfigError naming the first missing, unexpected or wrongly shaped tensor."""
    cfg = config_from_hf(hf_config)
    L = cfg.n_layer
    ours: dict[str, torch.Tensor] = {}
    if cfg.moe is not None:  # the router and experts first (either Mixtral layout), then the Llama's names
        ours, state_dict = mixtral.experts_from_hf(state_dict)
    for hf, t in state_dict.items():
        if _ROTARY_BUFFER.search(hf):
            continue
        name = _our_name(hf, L)
        if not name:
            raise ConfigError(f"from_hf: unexpected tensor {hf!r}: not a parameter of a LlamaForCausalLM with "
                              f"num_hidden_layers={L} (is it another architecture, or is num_hidden_layers wrong?); "
                              f"remove it or fix the config")
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # checked against the embedding below
        ours[name] = t
    want = state_dict_shapes(cfg)
    _check_shapes(ours, want, lambda n: _hf_name(n, L), "from_hf", _note(cfg))
    head = state_dict.get("lm_head.weight")
    if cfg.tie_word_embeddings and head is not None:
        emb = ours["layers.0.tok_embeddings.weight"]
        if tuple(head.shape) != tuple(emb.shape) or (head is not emb and not torch.equal(head, emb)):
            raise ConfigError("from_hf: tie_word_embeddings=True but 'lm_head.weight' differs from "
                              "'model.embed_tokens.weight'; set tie_word_embeddings=False in the config to keep "
                              "both, or drop lm_head.weight")
    return cfg, ours


def to_hf(state_dict: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(HF state dict, HF config dict) from our Llama's state dict (whole, not a tp/pp shard) and config."""
    L = cfg.n_layer
    want = state_dict_shapes(cfg)
    extra = [n for n in state_dict if n not in want]
    if extra:
        raise ConfigError(f"to_hf: unexpected tensor {extra[0]!r}: not a parameter of Llama({_note(cfg)}); "
                          f"pass the whole model's state dict (a tp or pp shard must be gathered first) with the "
                          f"config it was built from")
    _check_shapes(state_dict, want, lambda n: n, "to_hf", _note(cfg))
    hf = {_hf_name(n, L): state_dict[n] for n in want if ".feed_forward." not in n or cfg.moe is None}
    if cfg.moe is not None:
        hf.update(mixtral.experts_to_hf(state_dict, L, cfg.moe))
    if cfg.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # as HF's own state_dict() lists it
    return hf, config_to_hf(cfg)
