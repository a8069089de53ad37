"""Where a module's tokens sit in the sequence, and attention over it: the one-process default.

A model's modules that compute positions or attention ask their ``sequence`` attribute (a class
attribute, :data:`WHOLE` unless a context-parallel plan set another on the instance)::

    self.sequence.positions(T, device)   positions of the T tokens it holds: 0 .. T-1 here
    self.sequence.length(T)              the whole sequence's length: T here
    self.sequence.attend(q, k, v, causal=True, dropout_p=0.0, scale=None)
                                         q (B,h,T,d), k/v (B,g,T,d), g | h -> (B,h,T,d)

so the model reads the same code whether it holds the whole sequence (here) or, under context
parallelism, 1/N of it (``distrain.parallel.context_parallel.ContextParallel`` answers the same
three, its plan beside the model: ``models/gpt/plan.py``, ``models/llama/plan.py``). Nothing here
knows of parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["WHOLE", "WholeSequence", "expand_kv_heads"]


def expand_kv_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, g, T, d) key/value heads -> (B, h, T, d), g | h: head j serves query heads j*h/g ..
    (j+1)*h/g - 1 (grouped-query attention, Ainslie et al. 2023; Hugging Face's ``repeat_kv``)."""
    B, g, T, d = x.shape
    return x if g == h else x[:, :, None].expand(B, g, h // g, T, d).reshape(B, h, T, d)


class WholeSequence:
    """This process holds every token of the sequence, in order."""

    def positions(self, T: int, device=None) -> torch.Tensor:
        return torch.arange(T, device=device)                                    # (T,)

    def length(self, T: int) -> int:
        return T

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        h = q.shape[1]
        return F.scaled_dot_product_attention(q, expand_kv_heads(k, h), expand_kv_heads(v, h), dropout_p=dropout_p,
                                              is_causal=causal, scale=scale)     # (B, h, T, d)

    def __repr__(self) -> str:
        return "WHOLE"


WHOLE = WholeSequence()
