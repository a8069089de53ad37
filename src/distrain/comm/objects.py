"""Collectives of picklable Python objects, with torch.distributed's signatures.

    all_gather_object(object_list, obj)                 broadcast_object_list(object_list, src)
    gather_object(obj, object_gather_list, dst)         scatter_object_list(output, input_list, src)
    send_object_list(object_list, dst)                  recv_object_list(object_list, src=None) -> sender

An object travels as its pickle in a uint8 tensor. Sizes differ between ranks, so each call
first moves the sizes (one int64 per object), then the bytes padded to the largest size, through
the tensor collectives of api.py with the given ``algorithm=`` (the ledger records them under
those names). Like torch's, these unpickle what peers send: use them only between trusted ranks.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from distrain.comm import api
from distrain.comm.core import p2p
from distrain.comm.core.torchargs import torch_call
from distrain.errors import ConfigError


def _to_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor, n: int):
    return pickle.loads(t[:n].numpy().tobytes())


def _size(group) -> int:
    return dist.get_world_size(dist.group.WORLD if group is None else group)


def _my_group_rank(group) -> int:
    return dist.get_rank(dist.group.WORLD if group is None else group)


def _padded(t: torch.Tensor, m: int) -> torch.Tensor:
    out = torch.zeros(m, dtype=torch.uint8)
    out[:t.numel()] = t
    return out


@torch_call()
def all_gather_object(object_list, obj, group=None, algorithm: str = "native") -> None:
    P = _size(group)
    if not isinstance(object_list, list) or len(object_list) != P:
        raise ConfigError(f"all_gather_object: object_list must be a list of {P} entries (one per rank)")
    mine = _to_bytes(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(P)]
    api.all_gather(sizes, torch.tensor([mine.numel()]), group=group, algorithm=algorithm)
    m = max(int(s) for s in sizes)
    bufs = [torch.empty(m, dtype=torch.uint8) for _ in range(P)]
    api.all_gather(bufs, _padded(mine, m), group=group, algorithm=algorithm)
    for i in range(P):
        object_list[i] = _from_bytes(bufs[i], int(sizes[i]))


@torch_call("dst")
def gather_object(obj, object_gather_list=None, dst: int | None = None, group=None,
                  algorithm: str = "native") -> None:
    P = _size(group)
    dst = 0 if dst is None else dst
    root = dist.get_group_rank(dist.group.WORLD if group is None else group, dst) if group is not None else dst
    me = _my_group_rank(group)
    if me == root and (not isinstance(object_gather_list, list) or len(object_gather_list) != P):
        raise ConfigError(f"gather_object: object_gather_list must be a list of {P} entries on the "
                          f"destination rank {dst}")
    mine = _to_bytes(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(P)]
    api.all_gather(sizes, torch.tensor([mine.numel()]), group=group, algorithm=algorithm)
    m = max(int(s) for s in sizes)
    bufs = [torch.empty(m, dtype=torch.uint8) for _ in range(P)] if me == root else None
    api.gather(_padded(mine, m), bufs, dst=dst, group=group, algorithm=algorithm)
    if me == root:
        for i in range(P):
            object_gather_list[i] = _from_bytes(bufs[i], int(sizes[i]))


@torch_call("src")
def broadcast_object_list(object_list, src: int | None = None, group=None, device=None,
                          algorithm: str = "native") -> None:
    """Every rank's object_list (same length everywhere) becomes the source's, in place."""
    src = 0 if src is None else src
    if not isinstance(object_list, list):
        raise ConfigError("broadcast_object_list: object_list must be a list (the same length on every rank)")
    is_src = dist.get_rank() == src
    parts = [_to_bytes(o) for o in object_list] if is_src else []
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64) if is_src \
        else torch.zeros(len(object_list), dtype=torch.int64)
    api.broadcast(sizes, src=src, group=group, algorithm=algorithm)
    data = torch.cat(parts) if parts else torch.empty(int(sizes.sum()), dtype=torch.uint8)
    api.broadcast(data, src=src, group=group, algorithm=algorithm)
    if not is_src:
        at = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _from_bytes(data[at:], n)
            at += n


@torch_call("src")
def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src: int | None = None,
                        group=None, algorithm: str = "native") -> None:
    """scatter_object_output_list[0] <- the source's scatter_object_input_list[my group rank]."""
    P = _size(group)
    src = 0 if src is None else src
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ConfigError("scatter_object_list: Expected argument scatter_object_output_list to be a list of size "
                          "at least 1.")
    is_src = dist.get_rank() == src
    if is_src and (not isinstance(scatter_object_input_list, list) or len(scatter_object_input_list) != P):
        raise ConfigError(f"scatter_object_list: scatter_object_input_list must be a list of {P} objects on "
                          f"the source rank {src}")
    parts = [_to_bytes(o) for o in scatter_object_input_list] if is_src else []
    m = torch.tensor([max(p.numel() for p in parts)] if is_src else [0], dtype=torch.int64)
    api.broadcast(m, src=src, group=group, algorithm=algorithm)
    size = torch.zeros(1, dtype=torch.int64)
    api.scatter(size, [torch.tensor([p.numel()]) for p in parts] if is_src else None, src=src, group=group,
                algorithm=algorithm)
    buf = torch.empty(int(m), dtype=torch.uint8)
    api.scatter(buf, [_padded(p, int(m)) for p in parts] if is_src else None, src=src, group=group,
                algorithm=algorithm)
    scatter_object_output_list[0] = _from_bytes(buf, int(size))


@torch_call("dst")
def send_object_list(object_list, dst: int | None = None, group=None, device=None) -> None:
    if not isinstance(object_list, list) or dst is None:
        raise ConfigError("send_object_list: give a list of objects and dst= (or group_dst=)")
    parts = [_to_bytes(o) for o in object_list]
    p2p.send(torch.tensor([p.numel() for p in parts], dtype=torch.int64), dst, group)
    if parts:
        p2p.send(torch.cat(parts), dst, group)


@torch_call("src", nonmember_result=-1)
def recv_object_list(object_list, src: int | None = None, group=None, device=None) -> int:
    """Fill object_list (its length = the number of objects sent) from src (None: any rank);
    returns the sender's global rank."""
    if not isinstance(object_list, list):
        raise ConfigError("recv_object_list: object_list must be a list as long as the list that was sent")
    sizes = torch.empty(len(object_list), dtype=torch.int64)
    sender = p2p.recv(sizes, src, group)
    data = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    if data.numel():
        p2p.recv(data, sender, group)
    at = 0
    for i, n in enumerate(sizes.tolist()):
        object_list[i] = _from_bytes(data[at:], n)
        at += n
    return sender
