"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", arXiv:2501.18512): the model's parameters in P fragments, each synchronised once
every H steps at its own offset, its exchange optionally overlapped with τ inner steps.

**Fragments.** The parameter tensors, in the model's order, cut into P contiguous groups of whole tensors,
balanced by element count (:func:`fragment_cuts`: each cut at the tensor boundary nearest k·N/P). The paper
cuts by transformer block and finds a strided pattern (fragment p = blocks p, p + P, ...) slightly better
than a sequential one; a cut of the parameter list works for any model (no block structure needed) and keeps
the largest exchange near N/P, which is what bounds the peak bandwidth. Fragment p has its own
:class:`~distrain.parallel.diloco.outer.OuterStep`: its slice of θ_prev and its own outer optimizer state.

**Schedule.** Fragment p's offset is o_p = p·H // P; its exchange starts after every global step s with
(s + 1 − o_p) mod H = 0 (fragment 0 on DiLoCo's own schedule, (s + 1) mod H = 0; the others H/P steps
apart), so every fragment synchronises once per H steps and, with P ≤ H, only one fragment's bytes move
at a time.

**Overlap** (``overlap_steps`` τ, 0 ≤ τ < H). τ = 0: the exchange blocks and ends as DiLoCo's
(θ_i,p ← θ_prev,p). τ ≥ 1: at step s the fragment's outer gradient Δ_i,p = θ_prev,p − θ_i,p(s) is sent
(an asynchronous all-reduce) and the island keeps training; after step s + τ the average is applied:

    θ_prev,p ← OuterOpt(θ_prev,p, mean_i Δ_i,p)
    θ_i,p    ← α·θ_i,p(s + τ) + (1 − α)·θ_prev,p          (the paper's merge; α = ``alpha``)

α = 0 discards the τ inner steps' changes to the fragment (the global value wins), α = 1 keeps the island's
own; the paper tunes this mixing factor, and 0.5 (an even mix) is the default here (torchft's
Streaming DiLoCo writes the same merge as a lerp of the global value toward the local one). The next outer gradient of the fragment is again θ_prev,p − θ_i,p.
The quantized means (int8/int4: two blocking exchanges) are not asynchronous; the trainer refuses them
with τ ≥ 1.

**Checkpoints.** :meth:`StreamingOuter.state_dict` holds each fragment's OuterStep state, the cut, and
every exchange still to be applied (its fragment, the step after which it applies, and the averaged Δ,
waited for first), so a run resumed between a fragment's send and its apply continues exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.diloco.outer import Exchange, OuterStep


def fragment_cuts(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """[start, stop) tensor indices of ``parts`` contiguous fragments of tensors of ``sizes`` elements, each
    cut at the tensor boundary nearest to k·N/parts (N = sum(sizes)); every fragment holds at least one tensor."""
    if parts < 1:
        raise ConfigError(f"--fragments must be >= 1 (1: all parameters synchronise together), got {parts}")
    if parts > len(sizes):
        raise ConfigError(f"--fragments {parts}: the model has {len(sizes)} parameter tensors and a fragment holds "
                          f"whole tensors; use at most {len(sizes)}")
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    total, bounds = cum[-1], [0]
    for k in range(1, parts):
        lo, hi = bounds[-1] + 1, len(sizes) - (parts - k)  # leave a tensor for each fragment still to cut
        bounds.append(min(range(lo, hi + 1), key=lambda j: (abs(parts * cum[j] - k * total), j)))
    bounds.append(len(sizes))
    return list(zip(bounds, bounds[1:]))


def offsets(parts: int, inner_steps: int) -> list[int]:
    """o_p = p·H // P: fragment p's exchange starts after global steps s with (s + 1 − o_p) mod H = 0."""
    return [p * inner_steps // parts for p in range(parts)]


class StreamingOuter:
    """The outer half of Streaming DiLoCo for ``params`` (this rank's replica, in order): ``fragments`` P,
    ``inner_steps`` H, ``overlap_steps`` τ, ``alpha`` the merge's α (used with τ ≥ 1); ``outer`` the
    OuterStep keywords (group, islands, optimizer, lr, momentum, algorithm, compression, place,
    tensor_blocks, fixed_point, tensors: each fragment's OuterStep gets its params' entries of ``tensors``).

    ``whole`` (a rank of a grid island holds pieces of some tensors: engines/diloco_grid.py): (the whole
    model's tensor sizes, in its order; each of ``params``' index among them). The cut is then the whole
    model's, and fragment p holds the params whose whole tensor lies in its cut, in ``params``' order: the
    plain fragment restricted to what this rank holds. A fragment of which the rank holds nothing keeps its
    schedule and sync count but exchanges nothing (the cross group's ranks hold the same tensors: all skip)."""

    def __init__(self, params, *, fragments: int, inner_steps: int, overlap_steps: int = 0, alpha: float = 0.5,
                 whole: tuple[list[int], list[int]] | None = None, **outer):
        self.params: list[nn.Parameter] = list(params)
        sizes, index = whole if whole is not None else ([p.numel() for p in self.params], range(len(self.params)))
        self.cuts = fragment_cuts(list(sizes), fragments)
        # each fragment's params, as positions in self.params (contiguous runs when whole is None)
        self.members = [[i for i, j in enumerate(index) if a <= j < b] for a, b in self.cuts]
        if not 0 <= overlap_steps < inner_steps:
            raise ConfigError(f"--overlap-steps must be in 0..--inner-steps - 1 = {inner_steps - 1} (an exchange "
                              f"is applied before the fragment's next one starts), got {overlap_steps}")
        if overlap_steps and outer.get("compression") in ("int8", "int4"):
            raise ConfigError(f"--overlap-steps {overlap_steps} with --outer-compression {outer['compression']}: "
                              f"the quantized mean is two blocking exchanges, not one asynchronous all-reduce; "
                              f"use --outer-compression bf16 or none, or --overlap-steps 0")
        # --layout-invariant on grid islands (``tensors`` given): each fragment's exponents come from its whole
        # tensors over every rank (exact.exponents_of), a world all-reduce in which a rank holding nothing of the
        # fragment takes part too (EmptyFragment's ``tensors``)
        tensors = outer.pop("tensors", None)  # (the model's tensor count, each of params' tensor among them)
        self.parts = [OuterStep([self.params[i] for i in m], **outer,
                                tensors=None if tensors is None else (tensors[0], [tensors[1][i] for i in m]))
                      if m else EmptyFragment(None if tensors is None else tensors[0]) for m in self.members]
        self.inner_steps, self.overlap_steps, self.alpha = inner_steps, overlap_steps, alpha
        self.offsets = offsets(fragments, inner_steps)
        self.pending: dict[int, tuple[int, Exchange]] = {}  # fragment -> (the step after which it applies, exchange)

    @property
    def master(self) -> list[torch.Tensor]:
        """θ_prev of every parameter, in the replica's order."""
        out: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for m, part in zip(self.members, self.parts):
            for i, t in zip(m, part.master):
                out[i] = t
        return out

    @property
    def syncs(self) -> int:
        """Outer steps taken, over all fragments (P per H steps)."""
        return sum(part.syncs for part in self.parts)

    def numels(self) -> list[int]:
        """Elements of each fragment (this rank's)."""
        return [sum(p.numel() for p in part.params) for part in self.parts]

    def due(self, fragment: int, step: int) -> bool:
        return (step + 1 - self.offsets[fragment]) % self.inner_steps == 0

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Collective over the cross group, after global step ``step``'s inner update: apply the exchanges due
        after it (sent τ steps ago), then start (τ ≥ 1) or complete (τ = 0) those of the fragments due now."""
        for p in sorted(self.pending):
            at, exchange = self.pending[p]
            if at == step:
                del self.pending[p]
                self.parts[p].apply(exchange.mean(), self.alpha)
        for p, part in enumerate(self.parts):
            if self.due(p, step):
                if self.overlap_steps == 0:
                    part.sync()
                else:
                    self.pending[p] = (step + self.overlap_steps, part.launch(part.outer_gradient()))

    def settle(self) -> None:
        """Wait for every exchange in flight (its mean stays pending until its step): the end of training, a
        checkpoint."""
        for _, exchange in self.pending.values():
            exchange.mean()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Each fragment's OuterStep state, the cut, and the averaged Δ of every exchange not yet applied."""
        self.settle()
        return {"cuts": [list(c) for c in self.cuts], "fragments": [part.state_dict() for part in self.parts],
                "pending": [{"fragment": p, "apply_after": at, "mean": ex.mean().clone()}
                            for p, (at, ex) in sorted(self.pending.items())]}

    @torch.no_grad()
    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        """Load :meth:`state_dict`'s output, checked against this model and these flags (outside input)."""
        ok = isinstance(state, dict) and state.get("cuts") == [list(c) for c in self.cuts] and \
            isinstance(state.get("fragments"), list) and len(state["fragments"]) == len(self.parts) and \
            isinstance(state.get("pending"), list)
        if not ok:
            raise ConfigError(f"--resume: {where} holds no Streaming DiLoCo outer state for {len(self.parts)} "
                              f"fragments of this model; resume with the --model and --fragments it was written with")
        for part, saved in zip(self.parts, state["fragments"]):
            part.load_state_dict(saved, where)
        pending: dict[int, tuple[int, Exchange]] = {}
        numels = self.numels()
        for entry in state["pending"]:
            p = entry.get("fragment") if isinstance(entry, dict) else None
            at, mean = (entry.get("apply_after"), entry.get("mean")) if isinstance(entry, dict) else (None, None)
            if not (isinstance(p, int) and 0 <= p < len(self.parts) and p not in pending and isinstance(at, int)
                    and torch.is_tensor(mean) and mean.shape == (numels[p],)
                    and (not numels[p] or mean.dtype == self.parts[p].master[0].dtype)):
                raise ConfigError(f"--resume: {where} holds a malformed pending exchange of Streaming DiLoCo "
                                  f"({entry if not isinstance(entry, dict) else sorted(entry)}); resume from "
                                  f"another checkpoint")
            exchange = Exchange(mean.clone(), None, None, 1)
            exchange.done = exchange.flat
            pending[p] = (at, exchange)
        self.pending = pending


class EmptyFragment:
    """A fragment of which this rank holds no tensor (a pipeline stage without it, a ZeRO-3 rank whose flat
    shards lie outside it): its outer steps are counted on schedule, nothing is exchanged (every rank of its
    cross group holds the same: none). ``tensors`` (the model's tensor count; --layout-invariant on grid
    islands): it still takes part in the fragment's exponent all-reduce over every rank, with zeros (a max's
    identity for |Δ|), as exact.exponents_of's ranks that hold pieces do."""

    def __init__(self, tensors: int | None = None):
        self.params: list[nn.Parameter] = []
        self.master: list[torch.Tensor] = []
        self.syncs = 0
        self.tensors = tensors

    def _exponents(self) -> None:
        if self.tensors:
            comm.all_reduce(torch.zeros(self.tensors, dtype=torch.float64), op="max", algorithm="native")

    def sync(self) -> None:
        self._exponents()
        self.syncs += 1

    def outer_gradient(self) -> torch.Tensor:
        return torch.zeros(0)

    def launch(self, flat: torch.Tensor) -> Exchange:
        self._exponents()
        return Exchange(flat, flat, None, 1)

    def apply(self, delta: torch.Tensor, alpha: float | None = None) -> None:
        self.syncs += 1

    def state_dict(self) -> dict:
        return {"master": [], "syncs": self.syncs}

    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        if not (isinstance(state, dict) and state.get("master") == [] and isinstance(state.get("syncs"), int)):
            raise ConfigError(f"--resume: {where} holds outer state for a fragment this rank does not hold; resume "
                              f"with the layout it was written with")
        self.syncs = state["syncs"]
