"""Collectives of picklable Python objects, with torch.distributed's signatures; and of data.

    all_gather_object(object_list, obj)                 broadcast_object_list(object_list, src)
    gather_object(obj, object_gather_list, dst)         scatter_object_list(output, input_list, src)
    send_object_list(object_list, dst)                  recv_object_list(object_list, src=None) -> sender

    all_gather_data(obj) -> [every rank's obj]          broadcast_data(obj, src) -> the source's obj
    gather_data(obj, dst) -> [every rank's obj] on dst, None elsewhere

An object travels as its pickle in a uint8 tensor. Sizes differ between ranks, so each call
first moves the sizes (one int64 per object), then the bytes padded to the largest size, through
the tensor collectives of api.py with the given ``algorithm=`` (the ledger records them under
those names). Like torch's, the ``*_object*`` collectives unpickle what peers send, which runs any
code a peer (or whoever reached its connection: Gloo does not authenticate) put in: they are
torch's API for user code between trusted ranks, and distrain itself never calls them.

The ``*_data`` collectives carry *data*: tensors, numbers, strings, None and lists, tuples and dicts
of them (a state dict, an RNG state, metric records). They travel in torch's tensor format
(``torch.save``) and are read back with ``torch.load(weights_only=True)``, torch's loader that
rebuilds tensors and plain containers only and refuses anything that would import or call code,
as distrain reads checkpoints. Every control message distrain exchanges between ranks uses them.
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from distrain.comm import api
from distrain.comm.core import p2p
from distrain.comm.core.failures import transport_errors
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


def _own_storage(obj):
    """``obj`` with every tensor that views a larger storage (a slice of a packed buffer) copied into its
    own: torch.save writes whole storages, and refuses one storage viewed as two dtypes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.untyped_storage().nbytes() != obj.numel() * obj.element_size() else obj
    if isinstance(obj, dict):
        return type(obj)((k, _own_storage(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_storage(v) for v in obj)
    return obj


def encode_data(obj) -> torch.Tensor:
    """``obj`` (tensors, numbers, strings, None, lists/tuples/dicts of them) as bytes in a uint8 tensor."""
    buf = io.BytesIO()
    torch.save(_own_storage(obj), buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def decode_data(t: torch.Tensor, n: int):
    """What :func:`encode_data` made, read with torch's weights-only loader (no code is run: anything
    but data raises ``pickle.UnpicklingError``)."""
    return torch.load(io.BytesIO(t[:n].numpy().tobytes()), weights_only=True)


def _all_gather(out: list, t: torch.Tensor, group, algorithm: str | None) -> None:
    if algorithm is None:  # torch.distributed's own: outside every traffic ledger
        with transport_errors("all_gather_data"):  # (a peer lost under it: PeerLostError, blamed as secondary)
            dist.all_gather(out, t, group=group)
    else:
        api.all_gather(out, t, group=group, algorithm=algorithm)


def _gather_sizes(mine: torch.Tensor, group, algorithm: str | None) -> tuple[list[torch.Tensor], int]:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_size(group))]
    _all_gather(sizes, torch.tensor([mine.numel()]), group, algorithm)
    return sizes, max(int(s) for s in sizes)


def all_gather_data(obj, group=None, algorithm: str | None = "native") -> list:
    """Every rank's ``obj`` (data only, see the module docstring), in group rank order. ``algorithm``
    None: torch.distributed's own all_gather, which the traffic ledger does not count (a checkpoint's
    bookkeeping is not training traffic)."""
    mine = encode_data(obj)
    sizes, m = _gather_sizes(mine, group, algorithm)
    bufs = [torch.empty(m, dtype=torch.uint8) for _ in sizes]
    _all_gather(bufs, _padded(mine, m), group, algorithm)
    return [decode_data(b, int(n)) for b, n in zip(bufs, sizes)]


def gather_data(obj, dst: int = 0, group=None, algorithm: str | None = "native") -> list | None:
    """Every rank's ``obj`` (data only) on global rank ``dst``, in group rank order; None elsewhere
    (``algorithm`` None: torch.distributed's own gather, outside the ledger)."""
    root = dist.get_group_rank(group, dst) if group is not None else dst
    me = _my_group_rank(group)
    mine = encode_data(obj)
    sizes, m = _gather_sizes(mine, group, algorithm)
    bufs = [torch.empty(m, dtype=torch.uint8) for _ in sizes] if me == root else None
    if algorithm is None:
        with transport_errors("gather_data"):  # (a peer lost under it: PeerLostError, blamed as secondary)
            dist.gather(_padded(mine, m), bufs, dst=dst, group=group)
    else:
        api.gather(_padded(mine, m), bufs, dst=dst, group=group, algorithm=algorithm)
    return [decode_data(b, int(n)) for b, n in zip(bufs, sizes)] if me == root else None


def broadcast_data(obj, src: int = 0, group=None, algorithm: str = "native"):
    """The source's ``obj`` (data only) on every rank (global rank ``src``; others pass anything)."""
    is_src = dist.get_rank() == src
    data = encode_data(obj) if is_src else None
    size = torch.tensor([data.numel() if is_src else 0], dtype=torch.int64)
    api.broadcast(size, src=src, group=group, algorithm=algorithm)
    if not is_src:
        data = torch.empty(int(size), dtype=torch.uint8)
    api.broadcast(data, src=src, group=group, algorithm=algorithm)
    return obj if is_src else decode_data(data, int(size))


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
