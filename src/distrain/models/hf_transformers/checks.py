"""Does tensor parallelism fit a model? Sizes against tp, before any rank starts.

``distrain.train(model=..., config=TrainConfig(tp=P))`` calls :func:`check_tp_fits` in the
caller, before spawning: a size that P does not divide would otherwise fail inside every rank
(a Hugging Face attention reshaping a head it does not hold whole). The sizes come from
``model.config``, by Hugging Face's names or distrain's::

    HF                      distrain            split by tensor parallelism as
    num_attention_heads     n_head              whole query heads per rank
    num_key_value_heads     n_kv_head           whole key/value heads per rank (grouped-query attention)
    hidden_size             n_embd              the attention's width, heads x head_dim (checked when it
                                                is that width: a config whose head_dim * heads differs
                                                from hidden_size does not split hidden_size)
    intermediate_size       intermediate_size   the MLP's gate/up columns and down rows
    vocab_size              vocab_size          the embedding's rows and the head's logits

A model that brings its own distrain plan (``model.tp_plan``, a TPPlan or a mapping of
distrain's styles) is not checked here: its plan decides what is split, and its own ``check``
runs in the ranks. The message names every size that does not fit, why it is split, and the
tp values that fit them all: the one tp size check,
:func:`~distrain.parallel.tensor_parallel.check_tp_divides`, with the rules of sizes.py
(``config_tp_sizes``, re-exported here, and ``split_rules``), which plan.py uses too.
"""

from __future__ import annotations

from distrain.models.hf_transformers.plan import hf_split_sizes, is_hf_model, log_plan_choice
from distrain.models.hf_transformers.sizes import config_tp_sizes, split_rules

__all__ = ["check_tp_fits", "config_tp_sizes"]


def check_tp_fits(model, tp: int) -> None:
    """Before any rank starts: ``model.config``'s sizes against ``tp`` (see the module docstring).
    Nothing to check for tp 1, a model without a config, or a model with its own distrain plan."""
    if model is None or tp == 1:
        return
    own = getattr(model, "tp_plan", None)
    if own and not is_hf_model(model):
        return  # the model's own plan says what it splits (and checks it in the ranks)
    sizes = config_tp_sizes(getattr(model, "config", None))
    sizes = hf_split_sizes(model, sizes)  # an HF decoder: drop what distrain's plan for it leaves whole
    if sizes:
        from distrain.parallel.tensor_parallel import check_tp_divides  # imported on use, as plan.py does

        check_tp_divides(tp, sizes, type(model).__name__, rules=split_rules(sizes))
    log_plan_choice(model)
