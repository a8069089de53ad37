"""The GPT: the model (``model.py``) and its tensor-parallel plan beside it (``plan.py``).

    model.py   GPT, GPTConfig and its layers (Embedding, Block, Head, ...), lm_loss, the KV-cache
               forward, generate (from models/sampling.py); knows nothing of parallelism
    plan.py    gpt_tp_plan (Megatron's layout), the GPT's tp size check and its all-reduce count

``from distrain.models.gpt import GPT, GPTConfig`` reads the model; the plan's names are
imported from plan.py on first use only (they bring tensor parallelism with them).
"""

from distrain.models.gpt.model import (
    GPT,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    MLPBlock,
    generate,
    lm_loss,
)

_PLAN = ("check_gpt_tp", "check_tp_sizes", "gpt_tp_plan", "tp_all_reduces_per_step")


def __getattr__(name):  # the plan (and tensor parallelism) is imported on first use only
    if name in _PLAN:
        from distrain.models.gpt import plan

        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Block", "CausalSelfAttention", "Embedding", "GPT", "GPTConfig", "Head", "MLPBlock", "check_gpt_tp",
    "check_tp_sizes", "generate", "gpt_tp_plan", "lm_loss", "tp_all_reduces_per_step",
]
