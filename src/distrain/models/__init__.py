"""Models for distrain. They know nothing about parallelism; each exposes
``self.layers`` (an nn.ModuleList run in a plain loop) so that pipeline and
tensor parallelism can be applied from outside.

One folder per model, the model and its tensor-parallel plan side by side: ``gpt/``, ``mlp/``,
``llama/`` (model.py + plan.py; llama/ also rope.py and hf.py, its Hugging Face state-dict
adapter); ``hf_transformers/``: Hugging Face transformers models (LlamaForCausalLM, Mistral,
Qwen2) under our tensor and pipeline parallelism. ``registry.py``: presets and the plan lookup.
``sampling.py``: ``generate`` (temperature, top-k, top-p, greedy), with the KV cache of
``kv_cache.py`` for our GPT and Llama (``new_cache`` / ``forward_cached``).
"""

from distrain.models.gpt import (
    GPT,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    MLPBlock,
    lm_loss,
)
from distrain.models.llama import Llama, LlamaConfig
from distrain.models.mlp import MLP, classification_loss
from distrain.models.outputs import logits_of
from distrain.models.sampling import generate
from distrain.models.registry import (
    MODEL_PRESETS,
    build_model,
    count_parameters,
    list_models,
    model_kind,
    preset_config,
)

__all__ = [
    "GPT",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "GPTConfig",
    "Head",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MLPBlock",
    "MODEL_PRESETS",
    "build_model",
    "classification_loss",
    "count_parameters",
    "generate",
    "list_models",
    "lm_loss",
    "logits_of",
    "model_kind",
    "preset_config",
]
