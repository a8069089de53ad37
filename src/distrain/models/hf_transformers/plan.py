"""Tensor parallelism for Hugging Face Llama-family decoders, without changing the model.

``LlamaForCausalLM`` (and ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
which use the same module names) split as Megatron-LM splits a decoder::

    embed_tokens            vocab      rows of the vocabulary, g on the output
    self_attn               f once on its input (hidden_states), shared by q, k and v
    self_attn.q/k/v_proj    colwise    whole heads per rank: num_attention_heads/P query heads,
                                       num_key_value_heads/P key/value heads (and their biases, Qwen2)
    self_attn.o_proj        rowwise    g on the output
    mlp                     f once on its input, shared by gate and up
    mlp.gate/up_proj        colwise    intermediate_size/P columns each
    mlp.down_proj           rowwise    g on the output
    lm_head                 colwise    the logits stay sharded (B, T, V/P); the plan's loss is the
                                       vocab-parallel cross entropy (exact: equal to cross entropy on the
                                       gathered logits), read from ``output.logits``

Why the model needs no change (checked against transformers 5.24's ``modeling_llama.py``):
the attention reshapes its projections with ``view(*input_shape, -1, head_dim)`` and its output
with ``reshape(*input_shape, -1)``, so column-sharded q/k/v give this rank's heads; grouped-query
attention repeats each key/value head ``num_key_value_groups = heads / kv heads`` times, a ratio
the split keeps (rank p's query heads use exactly its key/value heads, contiguous blocks of
both); the rotary embedding acts per head on ``head_dim``. No attribute is adjusted.

The one f per attention and per MLP: HF's decoder layer calls ``self_attn(hidden_states=...)``
by keyword, which the plan's ``copy_input`` style (a hook on the first positional input) does
not see, so the plan's preparation (its ``check``, run by ``apply_tensor_parallel`` before any
module changes) puts a keyword-aware forward pre-hook on each attention and MLP: f on the input,
with the tp group of the column-parallel projections (a no-op until they are). A block then
costs 2 all-reduces of B*T*C forward and 2 backward, as the GPT's.

Tied embeddings (``tie_word_embeddings=True``: ``lm_head.weight is embed_tokens.weight``): the
preparation puts :class:`TiedHead` in place of ``lm_head``; it reads the (vocab-parallel)
embedding's weight at each forward, so the weight stays one Parameter and the logits are the
same (B, T, V/P) shard. An embedding with ``padding_idx`` (``pad_token_id`` set) stays whole
(VocabParallelEmbedding has no padding row), and so does a tied head reading it (full logits,
the trainer's own loss). Sequence parallelism is not offered for these models.

Hugging Face's own ``tp_plan`` (``model.tp_plan``, styles "colwise", "rowwise",
"colwise_gather_output", "embedding_rowwise", ...): for a Llama-family decoder distrain
**ignores it** and applies the plan above (one f per attention instead of one per projection,
a vocab-parallel loss instead of gathered logits), and says so once (a log line from
``distrain.train``). For another Hugging Face model, :func:`translate_hf_tp_plan` translates it
where every style has an exact equivalent (table ``HF_STYLES``) and refuses it, naming the
style, where one has none.
"""

from __future__ import annotations

import fnmatch
import logging
import weakref
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.hf_transformers.pipeline import HFPipeline
from distrain.models.hf_transformers.sizes import split_rules
from distrain.models.outputs import logits_of

__all__ = ["HF_STYLES", "TiedHead", "hf_split_sizes", "hf_tp_plan", "hf_tp_plan_for", "hf_vocab_parallel_loss",
           "is_hf_decoder", "is_hf_model", "translate_hf_tp_plan"]

log = logging.getLogger("distrain.models.hf_transformers")

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------
# What the model is
# ---------------------------------------------------------------------------------------

def is_hf_model(model) -> bool:
    """A transformers ``PreTrainedModel`` (or a subclass of yours), without importing transformers."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(model).__mro__)


def _linears(m: nn.Module, names) -> bool:
    return all(type(getattr(m, n, None)) is nn.Linear for n in names)


def _parts(model: nn.Module) -> dict[str, list]:
    """Its Llama-family modules by role: {"attn", "mlp", "embed", "head"}: [(name, module)]."""
    parts: dict[str, list] = {"attn": [], "mlp": [], "embed": [], "head": []}
    for name, m in model.named_modules():
        last = name.rpartition(".")[2]
        if last == "self_attn" and all(hasattr(m, n) for n in _ATTN):
            parts["attn"].append((name, m))
        elif last == "mlp" and all(hasattr(m, n) for n in _MLP):
            parts["mlp"].append((name, m))
        elif last == "embed_tokens" and isinstance(getattr(m, "weight", None), torch.Tensor):
            parts["embed"].append((name, m))
        elif last == "lm_head" and isinstance(m, (nn.Linear, TiedHead)):
            parts["head"].append((name, m))
    return parts


def is_hf_decoder(model: nn.Module) -> bool:
    """A Hugging Face Llama-family decoder (LlamaForCausalLM, Mistral, Qwen2, Qwen3 ...) or its
    ``pipeline_layers`` wrapper: one token embedding, attentions with q/k/v/o_proj, MLPs with
    gate/up/down_proj (nn.Linear all)."""
    if not (is_hf_model(model) or isinstance(model, HFPipeline)):
        return False
    p = _parts(model)
    return len(p["embed"]) == 1 and bool(p["attn"]) and bool(p["mlp"])


def _tied(model: nn.Module) -> bool:
    p = _parts(model)
    if not p["embed"] or not p["head"]:
        return False
    emb = p["embed"][0][1]
    return any(isinstance(h, TiedHead) or getattr(h, "weight", None) is emb.weight for _, h in p["head"])


def _shards_vocab(model: nn.Module) -> bool:
    """The embedding is split by vocabulary rows (it has no padding row)."""
    p = _parts(model)
    return not p["embed"] or getattr(p["embed"][0][1], "padding_idx", None) is None


def _head_dim(attn: nn.Module, model: nn.Module) -> int:
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    cfg = getattr(model, "config", None)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------

def hf_vocab_parallel_loss(output, targets: torch.Tensor, tp) -> torch.Tensor:
    """The loss of the plan: vocab-parallel cross entropy of ``output.logits`` (this rank's
    (B, T, V/P) shard; Hugging Face's ModelOutput or a tensor) against the full targets."""
    from distrain.parallel.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_of(output), targets, tp)


class TiedHead(nn.Module):
    """``lm_head`` of a tied model under tensor parallelism: f on the input, then the logits with
    the token embedding's own weight (this rank's vocabulary rows once it is vocab-parallel), read
    at each forward from the module that holds ``embed_tokens``. No parameter of its own (the
    owner is referenced, not registered: one Parameter, no duplicate in the state dict)."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        self._owner = (owner,)  # a tuple: hidden from named_modules / state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distrain.parallel.tensor_parallel import copy_to_tp

        emb = self._owner[0].embed_tokens
        tp = getattr(emb, "tp", None)
        if tp is not None and tp.size > 1:
            x = copy_to_tp(x, tp)
        return F.linear(x, emb.weight)  # (B, T, V), or (B, T, V/P) for a vocab-parallel table


class _SharedInputF:
    """Forward pre-hook (with kwargs) on an attention or MLP: f once on the input its column-parallel
    projections share, positional or ``hidden_states=``/``x=`` by keyword; the tp group is the
    projection ``child``'s (nothing happens while it is a plain nn.Linear)."""

    def __init__(self, child: str):
        self.child = child

    def __call__(self, module, args, kwargs):
        from distrain.parallel.tensor_parallel import copy_to_tp

        tp = getattr(getattr(module, self.child, None), "tp", None)
        if tp is None or tp.size == 1:
            return None
        if args:
            return (copy_to_tp(args[0], tp),) + tuple(args[1:]), kwargs
        key = next((k for k in ("hidden_states", "x") if k in kwargs), None)
        if key is None:
            raise ConfigError(f"hf_tp_plan: {type(module).__name__} was called without its input as the first "
                              f"positional argument or as hidden_states=/x= (got keywords {sorted(kwargs)})")
        return args, {**kwargs, key: copy_to_tp(kwargs[key], tp)}


_SHARED_F: weakref.WeakSet = weakref.WeakSet()  # the attentions and MLPs that have their _SharedInputF hook


def _module_sizes(model: nn.Module) -> dict[str, set[int]]:
    """{HF name: sizes} of what the plan splits in ``model`` (a whole decoder or a pipeline wrapper)."""
    p = _parts(model)
    sizes: dict[str, set[int]] = {k: set() for k in ("num_attention_heads", "num_key_value_heads",
                                                     "intermediate_size", "vocab_size")}
    for _, a in p["attn"]:
        if _linears(a, _ATTN):
            hd = _head_dim(a, model)
            sizes["num_attention_heads"].add(a.q_proj.out_features // hd)
            sizes["num_key_value_heads"].add(a.k_proj.out_features // hd)
    for _, m in p["mlp"]:
        if _linears(m, _MLP):
            sizes["intermediate_size"].add(m.gate_proj.out_features)
    if _shards_vocab(model):
        sizes["vocab_size"].update(e.num_embeddings for _, e in p["embed"] if type(e) is nn.Embedding)
    if not _tied(model):
        sizes["vocab_size"].update(h.out_features for _, h in p["head"] if type(h) is nn.Linear)
    return {k: v for k, v in sizes.items() if v}


def _prepare(model: nn.Module, tp: int, gather_logits: bool = False) -> None:
    """The plan's ``check``: the sizes (raising before anything changes), then the keyword-aware f
    hooks and, for a tied model, the TiedHead (see the module docstring)."""
    from distrain.parallel.tensor_parallel import check_tp_divides

    sizes = _module_sizes(model)
    rules = split_rules(sizes)
    check_tp_divides(tp, {k: min(v) for k, v in sizes.items()}, type(model).__name__, rules)
    for k, v in sizes.items():  # layers are alike; a model with several sizes: check each
        for n in v:
            check_tp_divides(tp, {k: n}, type(model).__name__, rules)
    p = _parts(model)
    tied = _tied(model)
    if tied and gather_logits:
        raise ConfigError("hf_tp_plan(gather_logits=True) gathers the logits of an nn.Linear lm_head; this model's "
                          "head is tied to the embedding (tie_word_embeddings=True): use gather_logits=False")
    if tp == 1:
        return
    for role, child in (("attn", "q_proj"), ("mlp", "gate_proj")):
        for _, m in p[role]:
            if m not in _SHARED_F:
                m.register_forward_pre_hook(_SharedInputF(child), with_kwargs=True)
                _SHARED_F.add(m)
    if tied and _shards_vocab(model):
        for name, h in p["head"]:
            if type(h) is nn.Linear:
                parent, _, attr = name.rpartition(".")
                holder = model.get_submodule(parent) if parent else model
                owner_name = p["embed"][0][0].rpartition(".")[0]
                setattr(holder, attr, TiedHead(model.get_submodule(owner_name) if owner_name else model))


def hf_tp_plan(model: nn.Module | None = None, gather_logits: bool = False):
    """distrain's plan for a Hugging Face Llama-family decoder (or its ``pipeline_layers`` wrapper).

    ``model`` (optional) says whether the head is tied and whether the embedding has a padding
    row (see the module docstring); without it the plan is the untied one.
    ``gather_logits=True`` (untied heads only): full logits on every rank, no loss of the plan's own."""
    from distrain.parallel.tensor_parallel import ColwiseParallel, TPPlan

    heads = ColwiseParallel(sync_input=False)  # the f is the attention's / MLP's shared-input hook
    layers: dict = {"self_attn.q_proj": heads, "self_attn.k_proj": heads, "self_attn.v_proj": heads,
                    "self_attn.o_proj": "rowwise", "mlp.gate_proj": heads, "mlp.up_proj": heads,
                    "mlp.down_proj": "rowwise"}
    tied = model is not None and _tied(model)
    vocab = model is None or _shards_vocab(model)
    if vocab:
        layers["embed_tokens"] = "vocab"
    if not tied:
        layers["lm_head"] = ColwiseParallel(gather_output=gather_logits)
    sharded_logits = (not tied and not gather_logits) or (tied and vocab)
    return TPPlan(layers, loss=hf_vocab_parallel_loss if sharded_logits else None,
                  check=lambda m, tp: _prepare(m, tp, gather_logits), sequence_dim=1)


def hf_split_sizes(model, sizes: Mapping[str, int]) -> dict[str, int]:
    """``sizes`` less what distrain's plan leaves whole in ``model`` (an HF decoder whose tied head
    reads an embedding with a padding row splits no vocabulary); other models: unchanged."""
    sizes = dict(sizes)
    if isinstance(model, nn.Module) and is_hf_decoder(model) and _tied(model) and not _shards_vocab(model):
        sizes.pop("vocab_size", None)
    return sizes


# ---------------------------------------------------------------------------------------
# Hugging Face's own tp_plan
# ---------------------------------------------------------------------------------------

def _hf_styles() -> dict:
    from distrain.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, VocabParallel

    return {
        "colwise": ColwiseParallel(),                                  # input replicated (f), output sharded
        "colwise_gather_output": ColwiseParallel(gather_output=True),  # ... output all-gathered
        "colwise_rep": ColwiseParallel(gather_output=True),
        "rowwise": RowwiseParallel(),                                  # input sharded, output all-reduced (g)
        "rowwise_rep": RowwiseParallel(input_is_parallel=False),       # input replicated: this rank's slice
        "rowwise_split_input": RowwiseParallel(input_is_parallel=False),
        "embedding_rowwise": VocabParallel(),                          # vocabulary rows, partial sums all-reduced
        "replicate": None,                                             # left whole
    }


HF_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_rep", "rowwise_split_input",
             "embedding_rowwise", "replicate")  # the Hugging Face styles with an exact distrain equivalent


def translate_hf_tp_plan(hf_plan: Mapping[str, str], model: nn.Module | None = None):
    """Hugging Face's ``{module pattern: style}`` as a distrain TPPlan, where every style has an exact
    equivalent (``HF_STYLES``); a ConfigError names the others ("local_colwise", "packed_rowwise",
    "sequence_parallel", "moe_tp_experts", ...) and the keys that name a parameter, not a module.
    With ``model``: an ``embedding_rowwise`` embedding with a padding row stays whole, and a
    column-parallel ``lm_head`` left sharded brings the vocab-parallel loss."""
    from distrain.parallel.tensor_parallel import ColwiseParallel, TPPlan, VocabParallel

    table = _hf_styles()
    bad = sorted({s for s in hf_plan.values() if s not in table})
    if bad:
        raise ConfigError(f"Hugging Face tp_plan: style(s) {bad} have no exact distrain equivalent (distrain "
                          f"translates {', '.join(HF_STYLES)}); pass distrain's plan yourself: "
                          f"parallelize(model, topo, tp_plan=TPPlan({{module name: 'colwise' | 'rowwise' | "
                          f"'vocab' | 'copy_input'}}), ...)")
    modules = dict(model.named_modules()) if model is not None else {}
    layers, loss = {}, None
    for key, style_name in hf_plan.items():
        style = table[style_name]
        if style is None:
            continue
        hits = [n for n in modules if n and (fnmatch.fnmatchcase(n, key) or fnmatch.fnmatchcase(n, "*." + key))]
        if model is not None and not hits:
            params = [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, key)]
            if params:
                raise ConfigError(f"Hugging Face tp_plan: {key!r} ({style_name}) names a parameter ({params[0]}); "
                                  f"distrain's plans name modules: pass distrain's plan yourself")
        if isinstance(style, VocabParallel) and any(getattr(modules[n], "padding_idx", None) is not None
                                                    for n in hits):
            continue  # a padding row: the embedding stays whole (exact)
        if isinstance(style, ColwiseParallel) and not style.gather_output and key.rpartition(".")[2] == "lm_head":
            loss = hf_vocab_parallel_loss
        layers[key] = style
    if not layers:
        raise ConfigError(f"Hugging Face tp_plan {dict(hf_plan)} splits nothing distrain can split")
    return TPPlan(layers, loss=loss)


# ---------------------------------------------------------------------------------------
# Which plan a model gets (registry.tp_plan_for) and the line that says so
# ---------------------------------------------------------------------------------------

def _hf_plan_of(model) -> Mapping | None:
    try:
        plan = getattr(model, "tp_plan", None)
    except Exception:  # noqa: BLE001 -- a property of another transformers version
        return None
    return plan if isinstance(plan, Mapping) and plan else None


def hf_tp_plan_for(model: nn.Module):
    """The plan for a Hugging Face model: distrain's :func:`hf_tp_plan` for a Llama-family decoder
    (or its pipeline wrapper), HF's own ``tp_plan`` translated for another HF model that has one,
    else None. Never imports transformers."""
    if is_hf_decoder(model):
        log.info("%s", _choice_line(model))
        return hf_tp_plan(model)
    if is_hf_model(model) and _hf_plan_of(model) is not None:
        log.info("%s", _choice_line(model))
        return translate_hf_tp_plan(_hf_plan_of(model), model)
    return None


def _choice_line(model) -> str | None:
    name, hf = type(model).__name__, _hf_plan_of(model)
    if is_hf_decoder(model):
        ours = ("distrain's plan for Llama-family decoders (distrain.models.hf_transformers.hf_tp_plan: embed_tokens "
                "vocab-parallel, q/k/v/gate/up column-parallel with one f per attention and MLP, o/down "
                "row-parallel, lm_head column-parallel with a vocab-parallel loss)")
        if hf is None:
            return f"distrain: tensor parallelism for {name} uses {ours}"
        return (f"distrain: {name} carries Hugging Face's tp_plan ({len(hf)} entries); distrain ignores it and "
                f"applies {ours}")
    if is_hf_model(model) and hf is not None:
        return (f"distrain: {name} is not a Llama-family decoder; its Hugging Face tp_plan is translated into "
                f"distrain's styles (exact equivalents only: {', '.join(HF_STYLES)})")
    return None


_LOGGED: set[str] = set()


def log_plan_choice(model) -> None:
    """Say once per process which plan a Hugging Face model gets (``distrain.train`` calls it
    before any rank starts)."""
    line = _choice_line(model) if isinstance(model, nn.Module) else None
    if line and line not in _LOGGED:
        _LOGGED.add(line)
        log.warning("%s", line)
