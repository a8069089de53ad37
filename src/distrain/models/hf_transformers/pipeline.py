"""Pipeline stages cut from a Hugging Face decoder's own list of layers, without rewriting it.

distrain's pipeline cuts ``model.layers``, a list of modules run in order, each taking and
returning one tensor. A Hugging Face ``LlamaForCausalLM`` keeps its decoder layers in
``model.model.layers`` and runs them with a causal mask and rotary position embeddings computed
once in ``LlamaModel.forward``. :func:`pipeline_layers` lays the same modules out as distrain's
pipeline wants them, sharing their parameter tensors (nothing is copied)::

    pipe = pipeline_layers(hf_model)        # pipe(input_ids) == hf_model(input_ids).logits
    pipe.layers = [HFEmbedding       embed_tokens: ids (B, T) -> hidden (B, T, C)
                   HFDecoderLayer    model.layers[i]: hidden -> hidden, with the causal mask (the model's
                     x n             own mask function: create_causal_mask, or the sliding-window one
                                     for Mistral / Qwen2's sliding layers) and the rotary (cos, sin)
                                     computed inside from the positions 0..T-1
                   HFHead]           norm + lm_head: hidden -> logits (B, T, V)

so ``parallelize(pipe, topo, ...)`` with pp > 1, or ``distrain.train(model=pipe, ...)``, cuts it
like distrain's own models (tensor parallelism too: :func:`~distrain.models.hf_transformers.plan.hf_tp_plan`
matches the same module names). ``pipe.config`` is the model's config.

Names (``pipe.state_dict()`` -> the Hugging Face model's; :meth:`HFPipeline.hf_name`,
:meth:`HFPipeline.to_hf_state_dict`)::

    layers.0.embed_tokens.*          model.embed_tokens.*
    layers.{i+1}.layer.*             model.layers.{i}.*          (i = 0 .. n-1)
    layers.{n+1}.norm.*              model.norm.*
    layers.{n+1}.lm_head.*           lm_head.*

(``model.`` is the model's ``base_model_prefix``.) So a checkpoint of the pipeline (the trainer's,
consolidated with ``distrain checkpoint consolidate``) loads into the Hugging Face model after
``pipe.to_hf_state_dict(sd)``.

Checks when it is built: the embedding and the head must not share a weight
(``tie_word_embeddings=True``: pipeline stages cannot share one Parameter; untie the model or do
not cut it), and ``verify=True`` (the default) runs both on a few tokens, in eval mode without
gradients, and refuses a model whose decoder does more than embed -> layers -> norm -> head
(Gemma scales its embeddings, for instance): the wrapper reproduces ``LlamaModel.forward``,
checked to equal LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM in the tests.
Attention masks other than causal (padding) are not passed: every sequence is whole, as the
trainer's batches are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.models.outputs import logits_of

__all__ = ["HFDecoderLayer", "HFEmbedding", "HFHead", "HFPipeline", "pipeline_layers"]


class HFEmbedding(nn.Module):
    """ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class HFDecoderLayer(nn.Module):
    """One Hugging Face decoder layer as a (B, T, C) -> (B, T, C) module: the causal mask and the
    rotary position embeddings of positions 0..T-1 are computed here, as the model's forward
    computes them once for all layers. ``rotary_emb`` is the model's (shared, no parameters)."""

    checkpointable = True  # --activation-checkpointing recomputes it in backward

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config, sliding: bool):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = sliding

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        T = hidden_states.shape[1]
        position_ids = torch.arange(T, device=hidden_states.device).unsqueeze(0)        # (1, T)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=hidden_states, attention_mask=None, cache=None,
                         position_ids=position_ids)
        cos_sin = self.rotary_emb(hidden_states, position_ids)                          # (1, T, hd) each
        out = self.layer(hidden_states, attention_mask=mask, position_embeddings=cos_sin, position_ids=position_ids)
        return out[0] if isinstance(out, tuple) else out                                # older versions: a tuple


class HFHead(nn.Module):
    """Final norm + lm_head: hidden states (B, T, C) -> logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))


class HFPipeline(nn.Module):
    """A Hugging Face decoder laid out as ``layers`` (see the module docstring); built by
    :func:`pipeline_layers`. ``forward(input_ids)`` returns the logits tensor."""

    def __init__(self, layers: list[nn.Module], config, hf_prefixes: dict[str, str]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.config = config
        self.hf_prefixes = dict(hf_prefixes)  # {our module path: the Hugging Face one}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = input_ids
        for layer in self.layers:
            x = layer(x)
        return x

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of parameter/buffer ``name`` of this wrapper."""
        for ours, theirs in self.hf_prefixes.items():
            if name.startswith(ours + "."):
                return theirs + name[len(ours):]
        raise ConfigError(f"HFPipeline.hf_name: {name!r} is not a name of this pipeline (its modules: "
                          f"{', '.join(self.hf_prefixes)})")

    def to_hf_state_dict(self, state_dict: dict) -> dict:
        """A state dict of this wrapper (e.g. a consolidated checkpoint) under the Hugging Face names,
        for ``hf_model.load_state_dict``. The tensors are not copied."""
        return {self.hf_name(k): v for k, v in state_dict.items()}


def _verify(hf_model: nn.Module, pipe: HFPipeline) -> None:
    p = next(iter(hf_model.parameters()), None)
    if p is None or p.device.type == "meta" or not p.dtype.is_floating_point:
        return
    cfg = pipe.config
    T = max(2, min(8, getattr(cfg, "max_position_embeddings", 8) or 8))
    ids = torch.randint(0, int(cfg.vocab_size), (1, T), generator=torch.Generator().manual_seed(0)).to(p.device)
    modes = {m: m.training for m in hf_model.modules()}
    try:
        hf_model.eval()
        with torch.no_grad():
            want, got = logits_of(hf_model(ids)), pipe(ids)
    finally:
        for m, mode in modes.items():
            m.training = mode
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 5e-2
    if want.shape != got.shape or not torch.allclose(want, got, rtol=tol, atol=tol * max(1.0, want.abs().max().item())):
        diff = (want - got).abs().max().item() if want.shape == got.shape else f"shapes {tuple(want.shape)} / " \
                                                                                  f"{tuple(got.shape)}"
        raise ConfigError(f"pipeline_layers: {type(hf_model).__name__} does not run as embed_tokens -> decoder layers "
                          f"-> norm -> lm_head (logits differ by {diff}); its decoder's forward does more (e.g. "
                          f"scales the embeddings), which this wrapper does not reproduce. Pass verify=False only if "
                          f"you know why they differ")


def pipeline_layers(hf_model: nn.Module, *, verify: bool = True) -> HFPipeline:
    """``hf_model`` (a Hugging Face ``...ForCausalLM`` of the Llama family) as an :class:`HFPipeline`
    whose ``layers`` distrain's pipeline can cut; the parameters are ``hf_model``'s own tensors.
    Raises ConfigError for a model of another layout, tied embeddings, or (``verify``) a model the
    wrapper does not reproduce."""
    prefix = getattr(hf_model, "base_model_prefix", "model") or "model"
    inner = getattr(hf_model, prefix, None)
    lm_head = getattr(hf_model, "lm_head", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not isinstance(inner, nn.Module) or not all(isinstance(getattr(inner, n, None), nn.Module) for n in need) \
            or not isinstance(lm_head, nn.Module):
        raise ConfigError(f"pipeline_layers: {type(hf_model).__name__} is not laid out as a Llama-family decoder "
                          f"(model.{prefix}.embed_tokens / layers / norm / rotary_emb and model.lm_head)")
    if getattr(lm_head, "weight", None) is not None and lm_head.weight is getattr(inner.embed_tokens, "weight", None):
        raise ConfigError(f"pipeline_layers: {type(hf_model).__name__} ties lm_head to embed_tokens "
                          f"(tie_word_embeddings=True); pipeline stages cannot share one weight (the first holds the "
                          f"embedding, the last the head). Train it untied (build it with tie_word_embeddings=False), "
                          f"or without a pipeline (tensor parallelism keeps the tie)")
    cfg = hf_model.config
    n = int(getattr(cfg, "num_hidden_layers", len(inner.layers)))
    layer_types = getattr(cfg, "layer_types", None)
    blocks = []
    for i, layer in enumerate(list(inner.layers)[:n]):
        kind = layer_types[i] if layer_types else ("sliding_attention" if getattr(cfg, "sliding_window", None)
                                                   else "full_attention")
        blocks.append(HFDecoderLayer(layer, inner.rotary_emb, cfg, sliding=kind == "sliding_attention"))
    prefixes = {"layers.0.embed_tokens": f"{prefix}.embed_tokens",
                **{f"layers.{i + 1}.layer": f"{prefix}.layers.{i}" for i in range(n)},
                f"layers.{n + 1}.norm": f"{prefix}.norm", f"layers.{n + 1}.lm_head": "lm_head"}
    pipe = HFPipeline([HFEmbedding(inner.embed_tokens), *blocks, HFHead(inner.norm, lm_head)], cfg, prefixes)
    if verify:
        _verify(hf_model, pipe)
    return pipe
