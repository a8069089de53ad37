"""The sizes tensor parallelism splits in a model's config, and why each is split (pure).

What plan.py (the plan's ``check``, in the ranks) and checks.py (``check_tp_fits``, before any
rank starts) hand to the one tp size check, :func:`~distrain.parallel.tensor_parallel.check_tp_divides`:
the sizes (:func:`config_tp_sizes`) and their rules (:func:`split_rules`); it imports neither.
The names it reads, Hugging Face's or distrain's, are in checks.py's table.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["config_tp_sizes", "split_rules"]

# name -> what tensor parallelism splits along it (distrain's names share HF's rule)
RULES = {
    "num_attention_heads": "every rank holds whole query heads",
    "num_key_value_heads": "grouped-query attention: every rank holds whole key/value heads, the ones its query "
                           "heads use",
    "hidden_size": "the attention's width, heads x head_dim, is split",
    "intermediate_size": "the MLP's gate/up columns and down rows are split",
    "vocab_size": "the embedding's rows and the head's logits are split",
}
_OURS = {"n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
         "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}


def split_rules(names) -> dict[str, str]:
    """{name: what tensor parallelism splits along it} for each of ``names`` (HF's or distrain's),
    the ``rules`` of :func:`~distrain.parallel.tensor_parallel.check_tp_divides`."""
    return {k: RULES.get(_OURS.get(k, k), "split by tensor parallelism") for k in names}


def _get(cfg, name: str):
    v = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def config_tp_sizes(config) -> dict[str, int]:
    """{name: size} of what tensor parallelism splits, read from a config (Hugging Face's, or
    distrain's GPTConfig/LlamaConfig, or a dict); sizes it does not hold are left out."""
    if config is None:
        return {}
    if callable(getattr(config, "get_text_config", None)):  # a composite HF config: its decoder's sizes
        config = config.get_text_config()
    names = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "vocab_size")
    if all(_get(config, k) is None for k in names[:3]):
        names = tuple(_OURS)  # distrain's names
    sizes = {k: v for k in names if (v := _get(config, k)) is not None}
    heads_name, hidden_name = names[0], names[2]
    head_dim = _get(config, "head_dim")
    if hidden_name in sizes and heads_name in sizes and head_dim is not None \
            and head_dim * sizes[heads_name] != sizes[hidden_name]:
        del sizes[hidden_name]  # heads x head_dim is split, not hidden_size
    return sizes
