"""The eight collectives, with torch.distributed's signatures, dispatched to an algorithm.

    broadcast(tensor, src)              reduce(tensor, dst, op)
    all_reduce(tensor, op)              scatter(tensor, scatter_list, src)
    gather(tensor, gather_list, dst)    all_gather(tensor_list, tensor)
    reduce_scatter(output, input_list, op)                       barrier()

Every one also takes ``group=None`` (a torch.distributed ProcessGroup; None = world),
``async_op=False`` and ``algorithm=`` one of:

* ``"native"``: torch.distributed's own call (Gloo/NCCL implement it);
* ``"star"``, ``"ring"``, ``"tree"``: ours, written on the P2P layer (algorithms/star.py, ring.py, tree.py).

Semantics follow torch.distributed: results are written in place; ``src``/``dst`` are
*global* ranks; only ``dst`` gets the result of reduce/gather; ``op`` is a ReduceOp or one
of "sum", "avg", "prod", "min", "max" (and "band", "bor", "bxor" for integers).
``avg`` is a sum divided by the group size once at the end (Gloo has no native AVG).

Contract: every rank of the group calls the same collectives, in the same order, with
matching shapes and dtypes. With debug checks on (``set_debug(True)``, which
``distrain.runtime.init`` calls when the launcher environment has ``DISTRAIN_DEBUG=1``), each call first exchanges a
fingerprint (sequence number, collective, algorithm, op, dtype, shape, root) with a native
all-gather, and a mismatch raises on every rank, naming the rank that differs.

async_op=True returns a handle with ``wait()`` and ``is_completed()``; our algorithms then
run on the group's worker thread (see core/group.py), native ones on the backend's. Argument
checks, the debug fingerprint and the dispatcher itself are in dispatch.py.

The fast path: a blocking native ``all_reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter`` or ``barrier`` on a group whose shared-memory transport runs the compiled
data plane goes straight to it (shm/compiled.py ``FastPath``, kept on the group's state and
found with ``group.fast_path``: a few Python operations instead of the dispatcher's hundred); anything it does not take (async, debug checks, other
algorithms, a ReduceOp object, odd arguments) takes the ordinary path below, which also
raises the proper error for bad arguments.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from distrain.comm.core import registry
from distrain.comm.dispatch import (  # noqa: F401  (COLLECTIVES, CommHandle, debug_enabled, set_debug: re-exported)
    COLLECTIVES,
    CommHandle,
    checked_tensor,
    checked_tensor_list,
    copy_back,
    debug_enabled,
    flat_view,
    root_list,
    run_collective,
    set_debug,
)
from distrain.comm.core.group import fast_path, resolve
from distrain.comm.core.ops import resolve_op
from distrain.comm.core.p2p import scratch
from distrain.comm.algorithms import ALGORITHM_NAMES  # noqa: F401  (re-exported)
from distrain.comm.core.torchargs import torch_call
from distrain.comm.core.util import nbytes
from distrain.errors import ConfigError


API_SLOT = -1  # scratch() slot of this module's temporaries (the algorithms use slots 0..P)


def _fast(group, async_op: bool, algorithm: str):
    """The group's FastPath when this call may take it, else None."""
    if async_op or algorithm != "native" or debug_enabled():
        return None
    return fast_path(group)


def broadcast(tensor: torch.Tensor, src: int = None, group=None, async_op: bool = False,  # noqa: RUF013
              algorithm: str = "native", **kwargs):
    fp = _fast(group, async_op, algorithm) if not kwargs else None
    if fp is not None and fp.broadcast(tensor, src):
        return None
    if src is not None:  # else torch's group_src= (in kwargs) names the root
        kwargs["src"] = src
    return _broadcast(tensor, group=group, async_op=async_op, algorithm=algorithm, **kwargs)


def all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False, algorithm: str = "native"):
    fp = _fast(group, async_op, algorithm)
    if fp is not None and fp.all_reduce(tensor, op):
        return None
    return _all_reduce(tensor, op, group, async_op, algorithm)


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False, algorithm: str = "native"):
    fp = _fast(group, async_op, algorithm)
    if fp is not None and fp.all_gather(tensor_list, tensor):
        return None
    return _all_gather(tensor_list, tensor, group, async_op, algorithm)


def reduce_scatter(output: torch.Tensor, input_list, op="sum", group=None, async_op: bool = False,
                   algorithm: str = "native"):
    fp = _fast(group, async_op, algorithm)
    if fp is not None and fp.reduce_scatter(output, input_list, op):
        return None
    return _reduce_scatter(output, input_list, op, group, async_op, algorithm)


def barrier(group=None, async_op: bool = False, device_ids=None, algorithm: str = "native",
            timeout: float | None = None):
    """Block until every rank of the group has entered. Ours: an all-reduce of one byte.

    ``timeout`` (seconds or a timedelta): raise CommError on this rank if the others have not
    all entered by then (the barrier is left posted; the group should then be torn down).
    ``device_ids`` is accepted for torch's signature (it only matters to NCCL).
    """
    fp = _fast(group, async_op, algorithm) if timeout is None else None
    if fp is not None and fp.barrier():
        return None
    return _barrier(group, async_op, device_ids, algorithm, timeout)


@torch_call('src')
def _broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, algorithm: str = "native"):
    name = "broadcast"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    tensor = checked_tensor(tensor, "tensor", name)
    root = st.group_rank(src, "src", name)
    flat = flat_view(tensor)
    after = (lambda: copy_back(tensor, flat)) if st.rank != root else None
    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.broadcast(pc, flat, root),
                          native=lambda a: dist.broadcast(flat, src, group=st.group, async_op=a),
                          after=after, fp=("", tensor, root))


@torch_call('dst')
def reduce(tensor: torch.Tensor, dst: int, op="sum", group=None, async_op: bool = False, algorithm: str = "native"):
    name = "reduce"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    tensor = checked_tensor(tensor, "tensor", name, op)
    o = resolve_op(op, tensor.dtype, name)
    root = st.group_rank(dst, "dst", name)
    flat = flat_view(tensor)

    def after() -> None:
        if st.rank == root:
            o.finish(flat, st.size)
            copy_back(tensor, flat)

    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.reduce(pc, flat, root, o),
                          native=lambda a: dist.reduce(flat, dst, op=o.native, group=st.group, async_op=a),
                          after=after, fp=(o.name, tensor, root))


@torch_call()
def _all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False, algorithm: str = "native"):
    name = "all_reduce"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    if mod is None and isinstance(tensor, torch.Tensor) and tensor.is_sparse:  # Gloo sums sparse COO itself
        return dist.all_reduce(tensor, op=resolve_op(op, tensor.dtype, name).native, group=st.group,
                               async_op=async_op)
    tensor = checked_tensor(tensor, "tensor", name, op)
    o = resolve_op(op, tensor.dtype, name)
    flat = flat_view(tensor)

    def after() -> None:
        o.finish(flat, st.size)
        copy_back(tensor, flat)

    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.all_reduce(pc, flat, o),
                          native=lambda a: dist.all_reduce(flat, op=o.native, group=st.group, async_op=a),
                          after=after, fp=(o.name, tensor, -1))


def has_list_all_reduce(group=None, algorithm: str = "native") -> bool:
    """Deprecated: :func:`all_reduce_list` runs on every group now, so this is always True."""
    warnings.warn("distrain.comm.has_list_all_reduce is always True (all_reduce_list runs on every group) and "
                  "will be removed in the next release", DeprecationWarning, stacklevel=2)
    return True


def all_reduce_list(tensors: list[torch.Tensor], *, scale: float | None = None, group=None, async_op: bool = False):
    """Sum a list of contiguous same-dtype tensors over the group in place, as one collective,
    each multiplied by ``scale`` first (e.g. 1/P for an average; the same bits as scaling each
    tensor, then summing). The tensors are packed into one flat buffer with one fused copy, the
    buffer is all-reduced (native algorithm), and the sums are unpacked with another: two calls
    for any number of tensors, where a copy per tensor costs a call each (a model's many small
    LayerNorm weights). Every rank passes tensors of the same sizes, in the same order."""
    name = "all_reduce"
    st = resolve(group, name)
    tensors = [checked_tensor(t, f"tensors[{i}]", name, "sum") for i, t in enumerate(tensors)]
    bad = [i for i, t in enumerate(tensors) if t.dtype != tensors[0].dtype or not t.is_contiguous()]
    if not tensors or bad:
        raise ConfigError(f"{name}: all_reduce_list takes a non-empty list of contiguous tensors of one dtype; "
                          f"tensors{bad} differ from tensors[0] ({tensors[0].dtype if tensors else None})")
    o = resolve_op("sum", tensors[0].dtype, name)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    views, dests = list(flat.split([t.numel() for t in tensors])), [t.view(-1) for t in tensors]
    torch._foreach_copy_(views, dests)
    if scale is not None:
        flat.mul_(scale)
    return run_collective(st, name, "native", async_op, nbytes(flat), mod=None,
                          ours=lambda m, pc: m.all_reduce(pc, flat, o),
                          native=lambda a: dist.all_reduce(flat, op=o.native, group=st.group, async_op=a),
                          after=lambda: torch._foreach_copy_(dests, views), fp=(o.name, flat, -1),
                          outputs=list(tensors))


@torch_call('src')
def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            algorithm: str = "native"):
    name = "scatter"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    tensor = checked_tensor(tensor, "tensor", name)
    root = st.group_rank(src, "src", name)
    lst = root_list(st, root, scatter_list, tensor, "scatter_list", "source", src, name)
    full = torch.cat([t.reshape(-1) for t in lst]) if lst is not None else None
    out = flat_view(tensor)
    if lst is not None:
        out.copy_(lst[root].reshape(-1))  # the source's own slot (also the whole result when P == 1)
    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.scatter(pc, out, full, root),
                          native=lambda a: dist.scatter(out, list(full.view(st.size, -1)) if lst else None, src,
                                                        group=st.group, async_op=a),
                          after=lambda: copy_back(tensor, out),
                          fp=("", tensor, root))


@torch_call('dst')
def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           algorithm: str = "native"):
    name = "gather"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    tensor = checked_tensor(tensor, "tensor", name)
    root = st.group_rank(dst, "dst", name)
    lst = root_list(st, root, gather_list, tensor, "gather_list", "destination", dst, name)
    n = tensor.numel()
    inp = tensor.reshape(-1).contiguous()
    full = torch.empty(st.size * n, dtype=tensor.dtype, device=tensor.device) if lst is not None else None
    if full is not None:
        full[st.rank * n:(st.rank + 1) * n].copy_(inp)  # own slot (also the P == 1 result)

    def after() -> None:
        if lst is not None:
            for i, t in enumerate(lst):
                t.copy_(full[i * n:(i + 1) * n].view(t.shape))

    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.gather(pc, inp, full, root),
                          native=lambda a: dist.gather(inp, list(full.view(st.size, n)) if lst is not None else None,
                                                       dst, group=st.group, async_op=a),
                          after=after, fp=("", tensor, root), outputs=lst or [])


@torch_call()
def _all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False, algorithm: str = "native"):
    name = "all_gather"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    tensor = checked_tensor(tensor, "tensor", name)
    lst = checked_tensor_list(tensor_list, tensor, st.size, "tensor_list", name, st.ranks[st.rank])
    n = tensor.numel()
    full = _adjacent_views(lst, n)  # gather straight into the caller's buffer when the list allows it
    direct = full is not None
    if not direct:  # a blocking call reuses a cached temporary (no page faults on a fresh 64 MiB)
        full = torch.empty(st.size * n, dtype=tensor.dtype, device=tensor.device) if async_op else \
            scratch(st.size * n, tensor.dtype, tensor.device, slot=API_SLOT)
    full[st.rank * n:(st.rank + 1) * n].copy_(tensor.reshape(-1))

    def after() -> None:
        if not direct:
            for i, t in enumerate(lst):
                t.copy_(full[i * n:(i + 1) * n].view(t.shape))

    def native(a: bool):
        return dist.all_gather(list(full.view(st.size, n)), full[st.rank * n:(st.rank + 1) * n].clone(),
                               group=st.group, async_op=a)

    return run_collective(st, name, algorithm, async_op, nbytes(tensor),
                          mod=mod, ours=lambda m, pc: m.all_gather(pc, full, n), native=native,
                          after=after, fp=("", tensor, -1), outputs=lst)


def _adjacent_views(lst: list[torch.Tensor], n: int) -> torch.Tensor | None:
    """One flat tensor covering ``lst`` if its tensors lie back to back in one contiguous storage
    (e.g. ``list(buf.view(P, n))``), else None. Lets all_gather skip a full-size temporary."""
    t0 = lst[0]
    if not all(t.is_contiguous() for t in lst):
        return None
    ptr, off = t0.untyped_storage().data_ptr(), t0.storage_offset()
    if any(t.untyped_storage().data_ptr() != ptr or t.storage_offset() != off + i * n for i, t in enumerate(lst)):
        return None
    return t0.as_strided((len(lst) * n,), (1,), off)


@torch_call()
def _reduce_scatter(output: torch.Tensor, input_list, op="sum", group=None, async_op: bool = False,
                    algorithm: str = "native"):
    name = "reduce_scatter"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    output = checked_tensor(output, "output", name, op)
    o = resolve_op(op, output.dtype, name)
    lst = checked_tensor_list(input_list, output, st.size, "input_list", name, st.ranks[st.rank])
    out = flat_view(output)
    # The input as one flat (P*n) tensor. Most algorithms overwrite it, so they get a work copy;
    # one that only reads it (READS_INPUT_ONLY: the direct shared-memory one) gets the caller's
    # buffer itself when the list lies back to back in it (reduce_scatter_tensor's blocks): one
    # full-size copy and allocation fewer.
    view = _adjacent_views(lst, out.numel()) if out.numel() else None
    copies: list[torch.Tensor] = []

    def full(reader=None) -> torch.Tensor:
        if view is not None and getattr(reader, "READS_INPUT_ONLY", False):
            return view
        if not copies:
            flat = [t.reshape(-1) for t in lst]
            copies.append(torch.cat(flat) if async_op else  # blocking: into a cached temporary, as all_gather
                          torch.cat(flat, out=scratch(out.numel() * st.size, out.dtype, out.device, slot=API_SLOT)))
        return copies[0]

    def after() -> None:
        if st.size == 1:
            out.copy_(full())
        o.finish(out, st.size)
        copy_back(output, out)

    return run_collective(st, name, algorithm, async_op, nbytes(output) * st.size,
                          mod=mod, ours=lambda m, pc: m.reduce_scatter(pc, out, full(m), o),
                          native=lambda a: _reduce_scatter_native(out, full(), op=o.native, group=st.group, async_op=a),
                          after=after, fp=(o.name, output, -1))


@torch_call()
def _barrier(group=None, async_op: bool = False, device_ids=None, algorithm: str = "native",
             timeout: float | None = None):
    name = "barrier"
    mod = registry.get(algorithm, name)
    st = resolve(group, name)
    token = torch.zeros(1, dtype=torch.uint8)
    sum_op = resolve_op("sum", token.dtype, name)
    h = run_collective(st, name, algorithm, async_op or timeout is not None, 0,
                       mod=mod, ours=lambda m, pc: m.all_reduce(pc, token, sum_op),
                       native=lambda a: dist.barrier(group=st.group, async_op=a),
                       after=None, fp=("", None, -1))
    if timeout is None or async_op:
        return h
    h.wait(timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
    return None


# torch renamed reduce_scatter_tensor to reduce_scatter_single; take whichever this torch has.
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The public functions keep the ordinary path's signatures (torch's, with group_src= for broadcast).
for _pub, _slow in ((broadcast, _broadcast), (all_reduce, _all_reduce), (all_gather, _all_gather),
                    (reduce_scatter, _reduce_scatter), (barrier, _barrier)):
    _pub.__signature__ = _slow.__signature__
