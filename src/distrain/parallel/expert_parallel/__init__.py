"""Expert parallelism: a mixture of experts' experts split across the ep ranks, tokens sent to them.

A mixture-of-experts layer (distrain.models.moe) sends each token to k of E experts. With ep ranks
each holding E/ep experts, every rank routes its own tokens and two all-to-alls with uneven splits
carry the chosen tokens to the ranks of their experts and the experts' outputs back (GShard,
Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022)::

    dispatch.py  ExpertParallel: the count exchange, the two all-to-alls (autograd), the router's
                 statistics summed over the step's ranks; ep_bytes, the traffic formula
    plan.py      EPPlan (which modules are mixtures) and apply_expert_parallel; the expert
                 gradients' reduction over the ranks holding the same experts
    sizes.py     check_ep_sizes, check_ep_layout, check_ep_flags: ep against the experts, the data ranks
                 and the other flags, one line each (the trainer's config calls them before start)

Where the ranks come from (as torchtitan's and Megatron-Core's expert parallelism): ep borrows from
the data-parallel ranks, dp x cp (Topology's ``ep`` and ``edp`` groups). Those ranks hold the same
non-expert parameters and read different tokens; ep of them pool their experts, so an ep group
holds the experts once, and the dp x cp / ep groups of it hold them as replicas. Non-expert
gradients are averaged over dp x cp (DDP); expert gradients are summed over their replicas
(``edp``) and divided by dp x cp (plan.py). Capacity unlimited, the step is the one-process step
exactly (fp64 through the trainer: tests/test_moe_train.py).
"""

from distrain.parallel.expert_parallel.dispatch import COUNTS_LABEL, LABEL, ExpertParallel, ep_bytes
from distrain.parallel.expert_parallel.plan import (
    EPPlan, apply_expert_parallel, expert_parameter_names, reduce_expert_gradients, sum_router_counts,
)
from distrain.parallel.expert_parallel.sizes import check_ep_flags, check_ep_layout, check_ep_sizes

__all__ = ["COUNTS_LABEL", "EPPlan", "ExpertParallel", "LABEL", "apply_expert_parallel", "check_ep_flags",
           "check_ep_layout", "check_ep_sizes",
           "ep_bytes", "expert_parameter_names", "reduce_expert_gradients", "sum_router_counts"]
