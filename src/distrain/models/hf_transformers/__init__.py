"""Hugging Face transformers models under distrain's tensor and pipeline parallelism, without
rewriting them (``LlamaForCausalLM``, Mistral, Qwen2, Qwen3: the models ``transformers`` builds).
Not our Llama's checkpoint adapter, which is :mod:`distrain.models.llama.hf`.

    plan.py      hf_tp_plan: the tensor-parallel plan of Llama-family decoders (LlamaForCausalLM,
                 Mistral, Qwen2, Qwen3), by module name; what distrain does with HF's own tp_plan
    pipeline.py  pipeline_layers(hf_model): the same modules laid out as ``.layers`` for the pipeline,
                 names mapping back to Hugging Face's
    checks.py    check_tp_fits: a model's sizes against tp, before any rank starts
    sizes.py     config_tp_sizes, split_rules: the sizes a config names and why each is split, pure,
                 for the one tp size check (distrain.parallel.tensor_parallel.check_tp_divides)
                 that plan.py and checks.py call

Nothing here imports transformers until a wrapper runs (the models bring it). See
docs/tensor_parallel.md and docs/pipeline_parallel.md ("A Hugging Face model").
"""

from distrain.models.hf_transformers.checks import check_tp_fits, config_tp_sizes
from distrain.models.hf_transformers.pipeline import HFDecoderLayer, HFEmbedding, HFHead, HFPipeline, pipeline_layers
from distrain.models.hf_transformers.plan import (
    HF_STYLES,
    TiedHead,
    hf_tp_plan,
    hf_tp_plan_for,
    hf_vocab_parallel_loss,
    is_hf_decoder,
    is_hf_model,
    translate_hf_tp_plan,
)

__all__ = [
    "HF_STYLES", "HFDecoderLayer", "HFEmbedding", "HFHead", "HFPipeline", "TiedHead", "check_tp_fits",
    "config_tp_sizes", "hf_tp_plan", "hf_tp_plan_for", "hf_vocab_parallel_loss", "is_hf_decoder",
    "is_hf_model", "pipeline_layers", "translate_hf_tp_plan",
]
