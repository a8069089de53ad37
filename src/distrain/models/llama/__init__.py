"""Llama-family decoders: the model (``model.py``, rotary embedding in ``rope.py``), its
tensor-parallel plan beside it (``plan.py``), and a pure Hugging Face state-dict adapter
(``hf.py``: names, shapes, configs; no I/O; not to be confused with
:mod:`distrain.models.hf_transformers`, Hugging Face's own models under our parallelism).
See docs/llama.md.

Presets (``build_model(name)``, registered in :mod:`distrain.models.registry`): ``llama-tiny``
and ``llama-small`` train on byte-level text; ``smollm2-135m``, ``llama-3.2-1b`` and
``llama-3-8b`` carry the published sizes for the cost model (``distrain plan``), which builds
them on the meta device (no weights): build them yourself under ``torch.device("meta")`` unless
you mean to allocate them.
"""

from distrain.models.llama.hf import config_from_hf, config_to_hf, from_hf, state_dict_shapes, to_hf
from distrain.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    LlamaBlock,
    LlamaConfig,
    LlamaEmbedding,
    LlamaHead,
    RMSNorm,
    TiedOutput,
    swiglu_hidden,
)

_PLAN = ("check_llama_tp", "check_llama_tp_sizes", "llama_tp_plan")


def __getattr__(name):  # the plan (and tensor parallelism) is imported on first use only
    if name in _PLAN:
        from distrain.models.llama import plan

        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Attention", "FeedForward", "Llama", "LlamaBlock", "LlamaConfig", "LlamaEmbedding", "LlamaHead", "RMSNorm",
    "TiedOutput", "check_llama_tp", "check_llama_tp_sizes", "config_from_hf", "config_to_hf", "from_hf",
    "llama_tp_plan", "state_dict_shapes", "swiglu_hidden", "to_hf",
]
