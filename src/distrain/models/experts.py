"""Where a mixture of experts' experts run, and the statistics its router needs: the one-process default.

A mixture-of-experts layer (:mod:`distrain.models.moe`) routes each token to k experts and asks its
``dispatch`` attribute (a class attribute, :data:`ALL_HERE` unless an expert-parallel plan set
another on the instance) for two things::

    self.dispatch.combine(x, ids, weights, experts)
        x (N, C) tokens, ids (N, k) int64 expert of each of a token's k slots (-1: dropped by the
        router's capacity), weights (N, k), experts {global id: module (M, C) -> (M, C)} the experts
        this process holds -> y (N, C) = sum over kept slots j of weights[t, j] * expert_ids[t, j](x[t])
    self.dispatch.token_totals(stats)
        stats (S,) float64 per-expert counts (and other sums) over this process's tokens -> the
        same sums over every token of the step (all data-parallel ranks); here: itself

so the layer reads the same code whether every expert is here (this module) or, under expert
parallelism, 1/ep of them (``distrain.parallel.expert_parallel.ExpertParallel`` answers the same
two, its plan beside the model: ``models/llama/plan.py`` ``llama_ep_plan``). Nothing here knows of
parallelism.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

__all__ = ["ALL_HERE", "AllExpertsHere", "run_experts"]


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: Mapping[int, nn.Module]) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * experts[ids[t, j]](x[t])`` over the slots whose expert is in
    ``experts``: x (N, C), ids/weights (N, k) -> (N, C). Every expert runs, on no token if none
    chose it, so each has a gradient (zeros) every step, as under expert parallelism."""
    y = x.new_zeros(x.shape)                                                   # (N, C)
    for e, expert in experts.items():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)                      # (M,), (M,)
        out = expert(x.index_select(0, tok))                                    # (M, C)
        y = y.index_add(0, tok, out * weights[tok, slot].unsqueeze(-1).to(out.dtype))
    return y


class AllExpertsHere:
    """This process holds every expert and every token of the step."""

    def combine(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: Mapping[int, nn.Module]) -> torch.Tensor:
        return run_experts(x, ids, weights, experts)

    def token_totals(self, stats: torch.Tensor) -> torch.Tensor:
        return stats

    def __repr__(self) -> str:
        return "ALL_HERE"


ALL_HERE = AllExpertsHere()
