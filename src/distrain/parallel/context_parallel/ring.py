"""Ring attention: keys and values go around the cp ring; each block's output is merged by its
log-sum-exp (online softmax). Liu, Zaharia & Abbeel, "Ring Attention with Blockwise
Transformers for Near-Infinite Context" (2023); the merge is the online softmax of Milakov &
Gimelshein (2018) as FlashAttention uses it (Dao et al. 2022, section 3.1).

Shapes: B batch, h query heads, g key/value heads (g divides h; grouped-query attention), d head
size, L = T / N local tokens of the causal load-balanced layout (:mod:`.load_balance`: rank r holds
chunks r and 2N-1-r of c = L / 2 tokens each).

Forward, on rank r of N: q (B,h,L,d) stays; the pair [k, v] (2,B,g,L,d) travels. At step s the
rank holds the keys and values of rank j = (r - s) mod N; before computing with them it posts
their send to rank r+1 and the receive of the next pair from rank r-1 (``isend``/``irecv``, so the
transfer overlaps the block's compute), and waits only after. Which part of the block is needed
under the causal mask follows from the chunk numbers (:func:`step_rows_cols`)::

    s = 0 (j = r)   all local queries x all local keys, causal within the local order
    j < r           all queries x the first chunk of j (chunk j < r <= 2N-1-r: fully visible;
                    chunk 2N-1-j > 2N-1-r: never)
    j > r           the second chunk of the queries (2N-1-r) x all of j's keys (fully visible)

Every step past the first costs 2c x c scores, the first (2c)^2 / 2: the same work on every rank.
Each block gives out_b = softmax(S_b) V_b and lse_b = log sum exp(S_b) per query row; two partial
results merge exactly by::

    lse = log(exp(lse_1) + exp(lse_2)),  out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

Backward (FlashAttention's, per block, with the final lse and D = rowsum(dO * O)): P = exp(S - lse),
dV_b = P^T dO, dS = P * (dO V_b^T - D), dQ += dS K_b * scale, dK_b = dS^T Q * scale. The pair [k, v]
goes round the ring again (N - 1 sends), and an accumulator [dk, dv] travels with it one step
behind: rank r adds its block's share and passes it on; after the N-th hop it is back at its owner,
complete. Its send overlaps the next block's compute.

Bytes one rank sends per attention call (e = element size, |kv| = B*g*L*d*e):
forward (N-1) * 2|kv|; backward (N-1) * 2|kv| + N * 2|kv| (:func:`ring_bytes`). The ledger counts
them under the label ``"cp-ring"``.
"""

from __future__ import annotations

import math

import torch

from distrain import comm
from distrain.comm.core import tags

__all__ = ["LABEL", "backward_step", "block_attention", "block_gradients", "expand_kv", "fold_kv", "forward_step",
           "merge", "ring_attention", "ring_bytes", "step_rows_cols"]

LABEL = "cp-ring"
TAG_KV, TAG_KV_BACK, TAG_DKV = (tags.CONTEXT_PARALLEL.at(i) for i in range(3))
_ALL = slice(None)


def step_rows_cols(step: int, rank: int, N: int, L: int, causal: bool = True) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal within) of ring step ``step`` on ``rank``: which local queries
    meet which keys of rank j = (rank - step) mod N under the load-balanced layout."""
    if not causal:
        return _ALL, _ALL, False
    if step == 0:
        return _ALL, _ALL, True
    j, c = (rank - step) % N, L // 2
    return (_ALL, slice(0, c), False) if j < rank else (slice(c, L), _ALL, False)


def expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, g, L, d) key/value heads -> (B, h, L, d): head j serves query heads j*h/g .. (j+1)*h/g-1."""
    B, g, L, d = x.shape
    return x if g == h else x[:, :, None].expand(B, g, h // g, L, d).reshape(B, h, L, d)


def fold_kv(dx: torch.Tensor, g: int) -> torch.Tensor:
    """The inverse of :func:`expand_kv` for gradients: (B, h, L, d) -> (B, g, L, d), summed per kv head."""
    B, h, L, d = dx.shape
    return dx if g == h else dx.view(B, g, h // g, L, d).sum(2)


TILE = 1 << 20  # elements of one tile of scores (B*h*rows*keys; 4 MiB in fp32): bounds the temporaries


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, first_row: int | None) -> torch.Tensor:
    """q k^T * scale (B, h, Tq, Tk); ``first_row`` not None: causal, q's row i is query first_row + i of
    a diagonal block, which sees keys j <= first_row + i."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale                             # (B, h, Tq, Tk)
    if first_row is not None:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(first_row + 1), float("-inf"))
    return s


def _tiles(q: torch.Tensor, Tk: int, causal: bool):
    """(rows a:b, keys, causal first row) tiles of a block of q (B,h,Tq,d) against Tk keys, each at most
    TILE scores; a causal (diagonal) tile needs the keys up to its last row only."""
    B, h, Tq, _ = q.shape
    rows = max(1, TILE // max(1, B * h * Tk))
    for a in range(0, Tq, rows):
        b = min(Tq, a + rows)
        yield a, b, (slice(0, b) if causal else _ALL), (a if causal else None)


FUSED = True  # use torch's fused CPU attention kernel for a block where it applies (False: the tiles below)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs in torch's fused CPU kernel (FlashAttention's algorithm, which returns the
    log-sum-exp and takes it back in backward): on the CPU, fp32 or fp64, when torch has it."""
    return FUSED and _FLASH is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (softmax(q k^T * scale) v, its row log-sum-exp). q (B,h,Tq,d), k/v (B,h,Tk,d) ->
    out (B,h,Tq,d), lse (B,h,Tq); ``causal``: query i sees keys j <= i (a diagonal block). In torch's
    fused CPU kernel where :func:`_fused`, else in tiles of query rows (:data:`TILE` scores each); no
    (Tq, Tk) matrix is ever whole either way."""
    if _fused(q):
        return _FLASH(q, k, v, 0.0, causal, scale=scale)
    B, h, Tq, _ = q.shape
    out = q.new_empty(B, Tq, h, v.shape[-1]).transpose(1, 2)  # (B, h, Tq, d) laid out as (B, Tq, h, d): the
    lse = q.new_empty(B, h, Tq)                                # caller's transpose(1, 2).reshape(B, Tq, h*d) is a view
    for a, b, keys, first in _tiles(q, k.shape[2], causal):
        s = _scores(q[:, :, a:b], k[:, :, keys], scale, first)                   # (B, h, b-a, keys)
        lse[:, :, a:b] = torch.logsumexp(s, dim=-1)
        out[:, :, a:b] = torch.matmul(torch.exp(s - lse[:, :, a:b, None]), v[:, :, keys])
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions over disjoint keys of the same queries."""
    new = torch.logaddexp(lse, lse_b)                                            # (B, h, Tq)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new


def forward_step(out, lse, q, k, v, step: int, rank: int, N: int, causal: bool, scale: float):
    """Merge ring step ``step``'s block (k, v: (B,g,L,d) of rank (rank - step) mod N) into (out, lse)
    (None before step 0, which covers every query row)."""
    rows, cols, diag = step_rows_cols(step, rank, N, q.shape[2], causal)
    h = q.shape[1]
    o_b, l_b = block_attention(q[:, :, rows], expand_kv(k[:, :, cols], h), expand_kv(v[:, :, cols], h), scale, diag)
    if out is None:
        return o_b, l_b
    o, l_ = merge(out[:, :, rows], lse[:, :, rows], o_b, l_b)
    out[:, :, rows], lse[:, :, rows] = o, l_                                   # (in place: no autograd here)
    return out, lse


def block_gradients(dout, q, k, v, out, lse, scale: float, causal: bool = False):
    """One block's share of the gradients, given the whole attention's output ``out`` and log-sum-exp
    ``lse`` for these query rows (FlashAttention's backward: P = exp(S - lse), D = rowsum(dO * O),
    dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K * scale, dK = dS^T Q * scale) -> (dq (B,h,Tq,d),
    dk, dv (B,h,Tk,d)). In torch's fused CPU kernel where :func:`_fused`, else in tiles."""
    if _fused(q):
        return _FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    D = (dout * out).sum(-1)                                                     # (B, h, Tq)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, keys, first in _tiles(q, k.shape[2], causal):
        q_t, do_t, k_t = q[:, :, a:b], dout[:, :, a:b], k[:, :, keys]
        p = torch.exp(_scores(q_t, k_t, scale, first) - lse[:, :, a:b, None])   # (B, h, b-a, keys)
        dv[:, :, keys] += torch.matmul(p.transpose(-2, -1), do_t)
        ds = p * (torch.matmul(do_t, v[:, :, keys].transpose(-2, -1)) - D[:, :, a:b, None])
        dq[:, :, a:b] += torch.matmul(ds, k_t) * scale
        dk[:, :, keys] += torch.matmul(ds.transpose(-2, -1), q_t) * scale
    return dq, dk, dv


def backward_step(dq, q, k, v, dout, out, lse, step: int, rank: int, N: int, causal: bool, scale: float):
    """Ring step ``step``'s share of the gradients: adds to ``dq`` (B,h,L,d) in place and returns
    (dk, dv) (B,g,L,d) of the keys and values of rank (rank - step) mod N (zero outside the block)."""
    rows, cols, diag = step_rows_cols(step, rank, N, q.shape[2], causal)
    h, g = q.shape[1], k.shape[1]
    dq_b, dk_b, dv_b = block_gradients(dout[:, :, rows], q[:, :, rows], expand_kv(k[:, :, cols], h),
                                       expand_kv(v[:, :, cols], h), out[:, :, rows], lse[:, :, rows], scale, diag)
    dq[:, :, rows] += dq_b
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[:, :, cols], dv[:, :, cols] = fold_kv(dk_b, g), fold_kv(dv_b, g)
    return dk, dv


class _Ring:
    """The cp ring as this rank sees it: post a pair's send to the next rank and the receive of
    the next pair from the previous one; ``wait`` completes both (the ledger counts them)."""

    def __init__(self, cp):
        self.cp = cp

    def start(self, send: torch.Tensor, tag: int):
        recv = torch.empty_like(send)
        cp = self.cp
        works = [comm.irecv(recv, cp.prev, cp.group, tag, label=LABEL),
                 comm.isend(send, cp.next, cp.group, tag, label=LABEL)]
        return recv, works

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, causal, scale):
        dtype, work = q.dtype, _work_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(work), k.to(work), v.to(work)
            ring, N, r = _Ring(cp), cp.size, cp.rank
            kv = torch.stack([k, v]).contiguous()                                # (2, B, g, L, d): one message
            out = lse = None
            for s in range(N):
                nxt, works = ring.start(kv, TAG_KV) if s < N - 1 else (None, [])
                out, lse = forward_step(out, lse, q, kv[0], kv[1], s, r, N, causal, scale)
                ring.wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale, ctx.dtype = cp, causal, scale, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        ring, N, r = _Ring(cp), cp.size, cp.rank
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype)
            dq = torch.zeros_like(q)
            kv = torch.stack([k, v]).contiguous()
            acc, acc_works = None, []                                            # the [dk, dv] on its way in
            for s in range(N):
                nxt, works = ring.start(kv, TAG_KV_BACK) if s < N - 1 else (None, [])
                dk, dv = backward_step(dq, q, kv[0], kv[1], dout, out, lse, s, r, N, causal, scale)
                mine = torch.stack([dk, dv])
                if acc is not None:                                              # what the ring brought so far
                    ring.wait(acc_works)
                    mine += acc
                acc, acc_works = ring.start(mine.contiguous(), TAG_DKV)          # on to the next rank
                ring.wait(works)
                kv = nxt
            ring.wait(acc_works)                                                 # back home: this rank's own
        dkv = acc.to(ctx.dtype)
        return dq.to(ctx.dtype), dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, keys and values passed around the
    ring of ``cp`` (a :class:`~.attention.ContextParallel`: group, rank, size, next, prev). q
    (B,h,L,d), k/v (B,g,L,d) in the load-balanced layout -> (B,h,L,d). Collective over the cp group."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, cp, causal, scale)


def ring_bytes(b: int, g: int, L: int, d: int, N: int, elem_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends (and receives) per ring attention call: forward N-1 pairs [k, v],
    backward N-1 pairs again plus N pairs [dk, dv]; each pair 2*b*g*L*d*elem_size (L = T/N)."""
    pair = 2 * b * g * L * d * elem_size
    return {"forward": (N - 1) * pair, "backward": (2 * N - 1) * pair,
            "forward_msgs": N - 1, "backward_msgs": 2 * N - 1}
