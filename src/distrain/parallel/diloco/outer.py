"""The outer step of DiLoCo on one rank: θ_prev, the outer optimizer, and the averaged outer gradient.

Per sync (every H inner steps), on every rank of every island:

    Δ_i   = θ_prev − θ_i                      (this island's outer gradient: its change since the last sync)
    Δ     = (1/K) Σ_i Δ_i                     (one all-reduce of the flat Δ_i over the cross group: K ranks)
    θ_prev ← outer optimizer step on θ_prev with gradient Δ    (torch.optim.SGD; nesterov=True for nesterov)
    θ_i   ← θ_prev                            (every island starts its next inner steps from it)

so after a sync every rank of every island holds the same parameters (bit for bit: the same all-reduce on
the same inputs) and the same outer state. With H = 1, outer SGD at lr 1 without momentum and inner SGD this
is DDP's step: θ_prev − mean_i(θ_prev − θ_i) = mean_i θ_i = θ_prev − lr · mean_i g_i.

``compression="bf16"``: Δ travels (and is summed by the ring) in bfloat16, half of float32's bytes, a quarter
of float64's; the mean is taken back in the parameters' dtype. ``"int8"``/``"int4"``: block-wise absmax
integers, averaged by a quantized reduce-scatter and all-gather (:mod:`distrain.parallel.diloco.quantized`;
about 4x and 7.5x fewer bytes than float32). The outer parameters and momentum stay in the parameters' dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.diloco import exact, quantized

OUTER_OPTIMIZERS = ("nesterov", "sgd")
OUTER_COMPRESSIONS = ("bf16", "int8", "int4")


class Exchange:
    """One outer gradient on its way: the flat Δ_i (numel,), what travels (``wire``: Δ_i itself, its bf16
    copy, or with ``fixed`` its int64 integers) and the all-reduce's handle (None: done, or nothing to wait
    for); :meth:`mean` waits and gives the islands' mean, in Δ_i's storage. ``fixed``: (the pieces' sizes,
    their exponents, whether each is finite) of a fixed-point sum (distrain.parallel.diloco.exact)."""

    def __init__(self, flat: torch.Tensor, wire: torch.Tensor | None, handle, islands: int, fixed=None):
        self.flat, self.wire, self.handle, self.islands, self.fixed = flat, wire, handle, islands, fixed
        self.done: torch.Tensor | None = None

    @torch.no_grad()
    def mean(self) -> torch.Tensor:
        if self.done is None:
            if self.handle is not None:
                self.handle.wait()
            if self.fixed is not None:
                self.done = exact.from_integers(self.wire, *self.fixed, self.islands, self.flat)
                return self.done
            if self.wire is not self.flat:
                self.flat.copy_(self.wire)
            self.done = self.flat.div_(self.islands)
        return self.done


class OuterStep:
    """The outer half of DiLoCo for ``params`` (this rank's island replica, in order).

    ``group``: the ranks of this rank's place in every island (IslandGroups.cross_group; None: one island,
    nothing to average); ``islands``: K; ``optimizer``: nesterov or sgd, with ``lr`` and ``momentum``
    (nesterov needs momentum > 0, as torch's SGD); ``algorithm``: the all-reduce's (distrain.comm);
    ``place``: this rank's index in ``group`` (its island), which owns a chunk of the quantized mean;
    ``fixed_point`` (--layout-invariant): the mean is an int64 sum at one exponent per parameter shared
    by the islands (distrain.parallel.diloco.exact), whose bits depend on the K outer gradients alone (not
    with ``compression``); ``tensor_blocks`` (int8/int4 on grid islands, whose ranks hold tensor slices
    beside tensors every tp rank holds alike): each parameter starts a new quantization block
    (quantized.quantized_mean's ``sizes``), so a replicated tensor is rounded alike on every rank holding it;
    False: the blocks run across the flat Δ, as plain DiLoCo's. ``tensors`` (with ``fixed_point`` on grid
    islands): (the whole model's tensor count, each of ``params``' tensor among them): the exponents are the
    whole tensors' (exact.exponents_of), so the mean has the bits a plain island's would."""

    def __init__(self, params, *, group, islands: int, optimizer: str = "nesterov", lr: float = 0.7,
                 momentum: float = 0.9, algorithm: str = "ring", compression: str | None = None, place: int = 0,
                 fixed_point: bool = False, tensor_blocks: bool = False,
                 tensors: tuple[int, list[int]] | None = None):
        if optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(f"--outer-optimizer {optimizer!r} is unknown; use {' or '.join(OUTER_OPTIMIZERS)}")
        if compression not in (None,) + OUTER_COMPRESSIONS:
            raise ConfigError(f"--outer-compression {compression!r} is unknown; use {' or '.join(OUTER_COMPRESSIONS)}")
        if fixed_point and compression is not None:
            raise ConfigError(f"--layout-invariant sums the outer gradients as integers; drop --outer-compression "
                              f"{compression}")
        self.fixed_point = fixed_point
        self.params: list[nn.Parameter] = list(params)
        self.group, self.islands, self.algorithm, self.compression = group, islands, algorithm, compression
        self.place, self.tensor_blocks, self.tensors = place, tensor_blocks, tensors
        # θ_prev: the outer parameters, a copy of the replica's at the last sync (leaves, for the optimizer)
        self.master = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.master, lr=lr, momentum=momentum, nesterov=optimizer == "nesterov")
        self.syncs = 0  # outer steps taken (this run's and, after a resume, the checkpoint's)

    @torch.no_grad()
    def outer_gradient(self) -> torch.Tensor:
        """This island's Δ_i = θ_prev − θ_i, flat (numel,), in the parameters' dtype."""
        return torch.cat([(m - p.detach()).reshape(-1) for m, p in zip(self.master, self.params)])

    @torch.no_grad()
    def sync(self) -> None:
        """Collective over ``group``: average Δ over the islands, the outer step, θ_i ← θ_prev."""
        self.apply(self.mean(self.outer_gradient()))

    @torch.no_grad()
    def mean(self, flat: torch.Tensor) -> torch.Tensor:
        """Collective over ``group`` (blocking): the islands' mean of ``flat`` (this island's Δ_i, (numel,)),
        computed in place where it can be (float32/float64 and bf16 on the wire) or as the quantized mean."""
        if self.group is not None and self.compression in quantized.BITS:
            sizes = [m.numel() for m in self.master] if self.tensor_blocks else None
            return quantized.quantized_mean(flat, group=self.group, parts=self.islands, rank=self.place,
                                            bits=quantized.BITS[self.compression], algorithm=self.algorithm,
                                            sizes=sizes)
        return self.launch(flat, async_op=False).mean()

    @torch.no_grad()
    def launch(self, flat: torch.Tensor, async_op: bool = True) -> "Exchange":
        """Start the sum of ``flat`` (this island's Δ_i, (numel,)) over ``group``: on the wire in the parameters'
        dtype or in bf16, or (``fixed_point``) as int64 at exponents from one blocking all-reduce (max) first;
        asynchronous unless ``async_op`` is False; :meth:`Exchange.mean` gives the mean (the quantized forms
        are two blocking exchanges: :meth:`mean` only)."""
        if self.fixed_point:  # (one island too: its mean is its Δ through the same integers, as any K's)
            sizes = [m.numel() for m in self.master]
            exponents, finite = exact.exponents_of(flat, sizes, self.islands, self.group, self.tensors)
            wire = exact.to_integers(flat, sizes, exponents)
            handle = None if self.group is None else comm.all_reduce(wire, op="sum", group=self.group,
                                                                     algorithm=self.algorithm, async_op=async_op)
            return Exchange(flat, wire, handle, self.islands, fixed=(sizes, exponents, finite))
        if self.group is None:
            return Exchange(flat, flat, None, self.islands)
        wire = flat.to(torch.bfloat16) if self.compression == "bf16" else flat
        handle = comm.all_reduce(wire, op="sum", group=self.group, algorithm=self.algorithm, async_op=async_op)
        return Exchange(flat, wire, handle, self.islands)

    @torch.no_grad()
    def apply(self, delta: torch.Tensor, alpha: float | None = None) -> None:
        """The outer step on θ_prev with the averaged outer gradient ``delta`` (numel,), then the replica:
        θ_i ← θ_prev (``alpha`` None), or θ_i ← α·θ_i + (1 − α)·θ_prev (Streaming DiLoCo's merge of the
        inner steps taken while the average was in flight: :mod:`distrain.parallel.diloco.streaming`)."""
        offset = 0
        for m in self.master:
            n = m.numel()
            m.grad = delta[offset:offset + n].view_as(m)
            offset += n
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            m.grad = None
            if alpha is None:
                p.copy_(m)
            else:
                p.mul_(alpha).add_(m, alpha=1.0 - alpha)
        self.syncs += 1

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """θ_prev, the outer optimizer's state (momentum buffers) and the sync count."""
        return {"master": [m.detach().clone() for m in self.master], "optimizer": self.optimizer.state_dict(),
                "syncs": self.syncs}

    @torch.no_grad()
    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        """Load :meth:`state_dict`'s output, checked against this model (a checkpoint is outside input)."""
        master = state.get("master") if isinstance(state, dict) else None
        ok = isinstance(master, list) and len(master) == len(self.master) and all(
            torch.is_tensor(a) and a.shape == b.shape for a, b in zip(master, self.master))
        if not ok:
            raise ConfigError(f"--resume: {where} holds no DiLoCo outer state for this model (its outer parameters "
                              f"are missing or of other shapes); resume with the model and --strategy diloco it was "
                              f"written with")
        for m, saved in zip(self.master, master):
            m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.syncs = int(state.get("syncs", 0))
