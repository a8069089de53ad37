"""All-to-all: rank i's block j goes to rank j, landing in its slot i (a transpose across ranks).

    all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *, label=None)
    all_to_all(output_tensor_list, input_tensor_list)

Split sizes count rows of dim 0 (None = equal blocks), as in torch.distributed. ``native``
is Gloo's alltoall. ``p2p`` (the all-to-alls only) is the direct exchange on point-to-point:
every rank posts its receives, then its sends, one message per pair with a non-empty block (no
padding, no relay; both sides know every size from the split sizes, which must agree: a mismatch
is the transport's error, no size exchange checks it); the ledger counts the messages. Context
parallelism's all-to-all (Ulysses) and expert parallelism's token dispatch run on it.
Ours (star, ring, tree) is composed from that algorithm's own pieces, through rank 0 like the
other composed collectives:

1. an all_gather of every rank's 2P block sizes (what it sends to each rank, what it expects
   from each), so every rank knows the whole P x P size matrix S and checks it alike (a
   mismatch raises on every rank, before any payload moves);
2. each rank pads its P blocks to m = max S and the algorithm gathers the P*P*m matrix at rank 0;
3. rank 0 transposes it (block (i, j) -> (j, i)) and the algorithm scatters row j to rank j.

Traffic (payload elements, e = element size, N = P*m per rank): it is the algorithm's gather
plus its scatter of N, plus the size exchange (an all_gather of 2P int64 per rank); star:
rank 0 receives and sends (P-1)*N; tree: rank 0 receives and sends (P-1)*N across ceil(log2 P)
rounds; ring: rank at distance v from 0 relays (P-1-v)*N each way. The ledger records it under
``all_to_all`` (or the call's ``label=``). The price of padding is explicit: unequal splits move
P*m, not their sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.comm.core import registry
from distrain.comm.core.group import resolve
from distrain.comm.core.p2p import PeerComm, waitall
from distrain.comm.core.torchargs import torch_call
from distrain.comm.core.util import nbytes
from distrain.comm.dispatch import chain, checked_tensor, copy_back, flat_view, run_collective
from distrain.errors import CommError, ConfigError

NAME = "all_to_all"


def _counts(t: torch.Tensor, splits, P: int, what: str, name: str) -> list[int]:
    """Element counts of the P blocks of t along dim 0."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if splits is None or len(splits) == 0:
        if rows % P:
            raise ConfigError(f"{name}: {what} has {rows} rows, not divisible by the group size {P}; pass "
                              f"{what}_split_sizes")
        return [rows // P * per_row] * P
    if len(splits) != P or any(int(s) < 0 for s in splits) or sum(int(s) for s in splits) != rows:
        raise ConfigError(f"{name}: {what}_split_sizes={list(splits)} must be {P} non-negative row counts "
                          f"summing to {what}'s {rows} rows")
    return [int(s) * per_row for s in splits]


def _direct(pc: PeerComm, send: torch.Tensor, cin: list[int], recv: torch.Tensor, cout: list[int]) -> None:
    """``p2p``: block j of ``send`` (cin[j] elements) straight to group rank j, block i of ``recv``
    (cout[i]) from rank i; every receive posted, then every send, then all waited on (PeerComm skips
    empty blocks on both sides alike); this rank's own block is a copy."""
    r, blocks_in, blocks_out = pc.rank, torch.split(send, cin), torch.split(recv, cout)
    works = [pc.irecv(blocks_out[i], i) for i in range(pc.size) if i != r]
    works += [pc.isend(blocks_in[j], j) for j in range(pc.size) if j != r]
    blocks_out[r].copy_(blocks_in[r])
    waitall(works)


def _ours(pc: PeerComm, mod, send: torch.Tensor, cin: list[int], recv: torch.Tensor, cout: list[int]) -> None:
    P, r = pc.size, pc.rank
    sizes = torch.zeros(P * 2 * P, dtype=torch.int64)
    sizes[r * 2 * P:(r + 1) * 2 * P] = torch.tensor(cin + cout, dtype=torch.int64)
    mod.all_gather(pc, sizes, 2 * P)
    S = sizes.view(P, 2, P)  # S[i, 0, j]: i sends j; S[i, 1, j]: i expects from j
    if not torch.equal(S[:, 0, :], S[:, 1, :].t()):
        i, j = (S[:, 0, :] != S[:, 1, :].t()).nonzero()[0].tolist()
        raise CommError(f"{NAME}: rank (group) {i} sends {int(S[i, 0, j])} elements to rank {j}, which expects "
                        f"{int(S[j, 1, i])}; input and output split sizes must agree")
    m = int(S[:, 0, :].max())
    if m == 0:
        return
    padded = torch.zeros(P, m, dtype=send.dtype)
    for j, piece in enumerate(torch.split(send, cin)):
        padded[j, :cin[j]] = piece
    full = torch.empty(P * P * m, dtype=send.dtype) if r == 0 else None
    mod.gather(pc, padded.view(-1), full, 0)
    if r == 0:
        full = full.view(P, P, m).transpose(0, 1).contiguous().view(-1)
    mine = torch.empty(P * m, dtype=send.dtype)
    mod.scatter(pc, mine, full, 0)
    mine = mine.view(P, m)
    recv.copy_(torch.cat([mine[i, :cout[i]] for i in range(P)]))


@torch_call()
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,  # noqa: A002
                      input_split_sizes=None, group=None, async_op: bool = False, algorithm: str = "native", *,
                      label: str | None = None):
    """torch's all_to_all_single, with ``algorithm=`` one of native, p2p (the direct exchange), star,
    ring, tree; ``label``: the name the ledger counts it under (default ``all_to_all``)."""
    name = "all_to_all_single"
    direct = algorithm == registry.P2P
    mod = _direct if direct else _algorithm(algorithm, name)
    st = resolve(group, name)
    out, inp = checked_tensor(output, "output", name), checked_tensor(input, "input", name)
    if out.dtype != inp.dtype:
        raise ConfigError(f"{name}: output is {out.dtype} but input is {inp.dtype}; they must match")
    cin = _counts(inp, input_split_sizes, st.size, "input", name)
    cout = _counts(out, output_split_sizes, st.size, "output", name)
    send = inp.reshape(-1).contiguous()
    recv = flat_view(out)

    def after() -> None:
        if st.size == 1 and algorithm != "native":
            recv.copy_(send)
        copy_back(out, recv)

    def ours(m, pc: PeerComm) -> None:
        if direct:
            _direct(pc, send, cin, recv, cout)
        else:
            _ours(pc, m, send, cin, recv, cout)

    def native(a: bool):
        return dist.all_to_all_single(recv.view(out.shape), send.view(inp.shape),
                                      list(output_split_sizes) if output_split_sizes else None,
                                      list(input_split_sizes) if input_split_sizes else None,
                                      group=st.group, async_op=a)

    dummy = torch.empty((), dtype=inp.dtype)  # same on every rank: blocks may be empty on some ranks only
    return run_collective(st, NAME, algorithm, async_op, nbytes(inp),
                          mod=mod, ours=ours, native=native, after=after, fp=("", dummy, -1), outputs=[output],
                          label=label)


def _algorithm(name: str, collective: str):
    """The registered algorithm ``name`` (None for native); an unknown name lists p2p among the choices."""
    if name not in registry.names():
        raise ConfigError(f"{collective}: unknown algorithm {name!r}; use one of "
                          f"{', '.join((*registry.names(), registry.P2P))}")
    return registry.get(name, collective)


@torch_call()
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False,
               algorithm: str = "native"):
    """output_tensor_list[i] <- rank i's input_tensor_list[me]; tensors may differ in size."""
    name = "all_to_all"
    P = dist.get_world_size(dist.group.WORLD if group is None else group)
    for what, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != P:
            raise ConfigError(f"{name}: {what} must be a list of {P} tensors (one per rank of the group)")
        for i, t in enumerate(lst):
            checked_tensor(t, f"{what}[{i}]", name)
    inp = torch.cat([t.detach().reshape(-1) for t in input_tensor_list])
    out = torch.empty(sum(t.numel() for t in output_tensor_list), dtype=output_tensor_list[0].dtype)

    def copy_out() -> None:
        at = 0
        for t in output_tensor_list:
            t.detach().copy_(out[at:at + t.numel()].view(t.shape))
            at += t.numel()

    h = all_to_all_single(out, inp, [t.numel() for t in output_tensor_list],
                          [t.numel() for t in input_tensor_list], group=group, async_op=async_op,
                          algorithm=algorithm)
    if h is None:
        copy_out()
        return None
    return chain(h, copy_out, list(output_tensor_list), name)
