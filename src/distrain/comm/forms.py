"""torch.distributed's other shapes of the same collectives, built on the eight of api.py.

    all_gather_into_tensor(output, input)     output = the P inputs, concatenated or stacked on dim 0
    reduce_scatter_tensor(output, input, op)  input = P blocks on dim 0; rank r gets reduced block r
    all_reduce_coalesced(tensors, op)         one all_reduce of the tensors concatenated (flat)
    all_gather_coalesced(output_lists, inputs)  one all_gather of the inputs concatenated
    batch_isend_irecv([P2POp, ...])           post every send/receive, return their handles

Each takes ``algorithm=`` like the eight and moves exactly the bytes of the collective it
is built on (the ledger records it under that collective's name: ``all_gather``,
``reduce_scatter``, ``all_reduce``), so the traffic formulas of docs/comm.md apply as they are.
The coalesced forms make one call for many tensors, which is their point: P*(latency) once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.comm import api
from distrain.comm.dispatch import chain
from distrain.comm.core.p2p import irecv, isend
from distrain.comm.core.torchargs import not_member, torch_call, warn_not_member
from distrain.errors import ConfigError


def _size(group) -> int:
    return dist.get_world_size(dist.group.WORLD if group is None else group)


def _check_tensor(t, what: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")


def _blocks(big: torch.Tensor, small: torch.Tensor, P: int, what: str, name: str) -> list[torch.Tensor]:
    """big viewed as P blocks shaped like ``small`` (big is (P*d0, ...) or (P, *small.shape))."""
    _check_tensor(big, what, name)
    if big.numel() != P * small.numel() or big.dtype != small.dtype:
        raise ConfigError(
            f"{name}: {what} has {big.numel()} elements of {big.dtype}, but the group has {P} ranks and the "
            f"other tensor {small.numel()} elements of {small.dtype}; it must hold exactly {P} x that, same dtype"
        )
    if not big.is_contiguous():
        raise ConfigError(f"{name}: {what} must be contiguous (call .contiguous() first)")
    return list(big.detach().view(P, *small.shape).unbind(0))


@torch_call()
def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False, algorithm: str = "native"):
    name = "all_gather_into_tensor"
    _check_tensor(input_tensor, "input_tensor", name)
    outs = _blocks(output_tensor, input_tensor, _size(group), "output_tensor", name)
    h = api.all_gather(outs, input_tensor, group=group, async_op=async_op, algorithm=algorithm)
    if h is not None:
        h.set_outputs([output_tensor])
    return h


@torch_call()
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,  # noqa: A002
                          async_op: bool = False, algorithm: str = "native"):
    name = "reduce_scatter_tensor"
    _check_tensor(output, "output", name)
    ins = _blocks(input, output, _size(group), "input", name)
    return api.reduce_scatter(output, ins, op=op, group=group, async_op=async_op, algorithm=algorithm)


def _flat_same_dtype(tensors, what: str, name: str) -> torch.Tensor:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError(f"{name}: {what} must be a non-empty list of tensors")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{what}[{i}]", name)
    # complex tensors travel as their real view (torch does the same), so they coalesce with their real dtype
    tensors = [torch.view_as_real(t.detach()) if t.is_complex() else t for t in tensors]
    for i, t in enumerate(tensors):
        if t.dtype != tensors[0].dtype:
            raise ConfigError(f"{name}: {what}[{i}] is {t.dtype} but {what}[0] is {tensors[0].dtype}; "
                              f"coalesced tensors must share one dtype")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors) -> None:
    at = 0
    for t in tensors:
        t = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
        t.copy_(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()


@torch_call()
def all_reduce_coalesced(tensors, op="sum", group=None, async_op: bool = False, algorithm: str = "native"):
    """All-reduce every tensor of the list in one collective over their concatenation."""
    name = "all_reduce_coalesced"
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    flat = _flat_same_dtype(tensors, "tensors", name)
    h = api.all_reduce(flat, op=op, group=group, async_op=async_op, algorithm=algorithm)
    if h is None:
        _unflatten_into(flat, tensors)
        return None
    return chain(h, lambda: _unflatten_into(flat, tensors), list(tensors), name)


@torch_call()
def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op: bool = False,
                         algorithm: str = "native"):
    """output_tensor_lists[r][i] <- rank r's input_tensor_list[i], in one all_gather."""
    name = "all_gather_coalesced"
    P = _size(group)
    flat = _flat_same_dtype(input_tensor_list, "input_tensor_list", name)
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != P:
        raise ConfigError(f"{name}: output_tensor_lists must hold one list per rank ({P}), got "
                          f"{len(output_tensor_lists) if isinstance(output_tensor_lists, (list, tuple)) else '?'}")
    for r, lst in enumerate(output_tensor_lists):
        if [tuple(t.shape) for t in lst] != [tuple(t.shape) for t in input_tensor_list]:
            raise ConfigError(f"{name}: output_tensor_lists[{r}] shapes {[tuple(t.shape) for t in lst]} differ "
                              f"from input_tensor_list's {[tuple(t.shape) for t in input_tensor_list]}")
    gathered = [torch.empty_like(flat) for _ in range(P)]
    h = api.all_gather(gathered, flat, group=group, async_op=async_op, algorithm=algorithm)

    def copy_out() -> None:
        for g, lst in zip(gathered, output_tensor_lists):
            _unflatten_into(g, lst)

    if h is None:
        copy_out()
        return None
    return chain(h, copy_out, [t for lst in output_tensor_lists for t in lst], name)


def _is_p2p_op(p) -> bool:
    """Ours or torch.distributed.P2POp (same attributes): either may be batched."""
    return all(hasattr(p, a) for a in ("op", "tensor", "peer", "group", "tag"))


class P2POp:
    """One send or receive for :func:`batch_isend_irecv` (torch's P2POp: op is isend or irecv,
    ours or torch.distributed's)."""

    def __init__(self, op, tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
                 group_peer: int | None = None):
        kind = getattr(op, "__name__", "")
        if kind not in ("isend", "irecv"):
            raise ConfigError(f"P2POp: op must be isend or irecv (distrain.comm's or torch.distributed's), got {op!r}")
        if (peer is None) == (group_peer is None):
            raise ConfigError("P2POp: give exactly one of peer= (a global rank) or group_peer= (a rank inside group)")
        if peer is None:
            peer = dist.get_global_rank(dist.group.WORLD if group is None else group, group_peer)
        self.op, self.tensor, self.peer, self.group, self.tag = kind, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list) -> list:
    """Post every operation of the list (in order) and return their handles."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list or not all(map(_is_p2p_op, p2p_op_list)):
        raise ConfigError("Invalid ``p2p_op_list``: batch_isend_irecv takes a non-empty list of "
                          "distrain.comm.P2POp (or torch.distributed.P2POp)")
    works = []
    for p in p2p_op_list:
        if not_member(p.group):
            warn_not_member("batch_isend_irecv")
            continue
        kind = p.op if isinstance(p.op, str) else getattr(p.op, "__name__", "")
        fn = isend if kind == "isend" else irecv
        works.append(fn(p.tensor, p.peer, p.group, p.tag))
    return works
