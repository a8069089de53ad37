"""The outer gradient in 8 or 4 bits: block-wise absmax quantization and a quantized mean across islands.

Why: DiLoCo's outer all-reduce moves the whole model every H steps; over a slow link its bytes are the
cost. OpenDiLoCo/INTELLECT-1 (Jaghouar et al. 2024) send the pseudo-gradient in int8; Streaming DiLoCo
(Douillard et al. 2025) in 4 bits, with no loss they could measure. Integers cannot be summed by the ring
(the islands' scales differ, and int8 sums overflow), so the mean is taken as a reduce-scatter and an
all-gather, each on quantized payloads:

1. Δ_i (n,) is cut into K chunks on block boundaries; chunk j belongs to rank j of the cross group.
2. Every rank quantizes each chunk (block of ``BLOCK`` elements: one float32 scale = absmax / qmax, the
   values rounded to the nearest integer in [-qmax, qmax]) and sends chunk j to rank j: one all-to-all.
3. Rank j decodes the K versions of its chunk and sums them in rank order (the same order on every run),
   then divides by K: its chunk of the mean.
4. Rank j quantizes that mean chunk once more and the payloads are all-gathered; every rank decodes all
   K of them. The owner decodes its own payload too, so every rank of every island ends with the same
   bits.

Bytes sent by each rank per sync, with c(m) = the payload of m elements (m·bits/8 rounded up to whole
bytes, plus 4 bytes per block): Σ_{j≠me} c(chunk_j) in the all-to-all, then the all-gather of the K
payloads (each padded to the largest, c_max). Against float32's ring, 2(K−1)/K·4n: about 4× less in
8 bits and 7.5× less in 4 bits (the scales cost 4/BLOCK bytes per element).

Blocks that never mix two tensors (``sizes``, DiLoCo on grid islands): the flat Δ_i is the concatenation of
this rank's tensors (of a tensor-parallel rank: its slices, and whole the tensors every tp rank holds alike,
norms and the row-parallel bias), and a block that held the end of one and the start of the next would take
its scale from both. Two tp ranks would then round a replicated tensor with different scales and their copies
of it would part. With ``sizes`` each tensor starts a new block: it is zero-padded to whole blocks on the
wire (a zero leaves a block's absmax alone, is encoded as 0 and decodes to 0) and the padding is dropped
from the mean, so each element's mean depends on its own tensor's values only, wherever the tensor sits.

Error: each element of the mean is off by at most half a quantization step of the first round (per
island, averaged) plus half a step of the second: |mean − exact| ≤ Σ_i s_i/(2K) + s_mean/2, with s the
block's scale (:func:`error_bound`). No error feedback: the islands' residuals would make their
pseudo-gradients differ from the uncompressed run's in a way no test could pin down, and the published
runs above saw no loss without it at these widths.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.errors import ConfigError

BLOCK = 128  # elements per scale: 4 bytes of scale per 128 values (3 % of int8's payload)
BITS = {"int8": 8, "int4": 4}


def qmax(bits: int) -> int:
    """The largest integer magnitude: 127 for 8 bits, 7 for 4 (symmetric: -qmax .. qmax)."""
    return (1 << (bits - 1)) - 1


def payload_bytes(n: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of the encoding of ``n`` elements: the values, then a float32 scale per block."""
    return (n * bits + 7) // 8 + 4 * (-(-n // block))


def scales_of(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Per block of ``x`` (n,): absmax / qmax in float32 (1.0 for an all-zero block, so nothing divides by 0)."""
    n = x.numel()
    pad = (-n) % block
    a = torch.nn.functional.pad(x.detach().abs().to(torch.float32), (0, pad)).view(-1, block).amax(dim=1)
    s = a / qmax(bits)
    return torch.where(s > 0, s, torch.ones_like(s))


def encode(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """``x`` (n,) floating -> uint8 (payload_bytes(n),): the rounded values (int8 as bytes; 4 bits: two per
    byte, element 2i in the low nibble, offset by 8), then the scales' float32 bytes."""
    n = x.numel()
    s = scales_of(x, bits, block)
    per = s.repeat_interleave(block)[:n]
    q = torch.round(x.detach().to(torch.float32) / per).clamp_(-qmax(bits), qmax(bits)).to(torch.int8)
    if bits == 8:
        values = q.view(torch.uint8)
    else:
        u = (q + 8).to(torch.uint8)  # 1 .. 15
        if n % 2:
            u = torch.cat([u, u.new_full((1,), 8)])  # a zero in the last byte's high nibble
        values = u[0::2] | (u[1::2] << 4)
    return torch.cat([values, s.view(torch.uint8)])


def decode(payload: torch.Tensor, n: int, bits: int, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """The inverse of :func:`encode` for ``n`` elements, in ``dtype``. A payload of another length is an
    error (it came over the wire: its size is checked before any byte is read as a value)."""
    nv = (n * bits + 7) // 8
    if payload.dtype != torch.uint8 or payload.numel() < payload_bytes(n, bits, block):
        raise ConfigError(f"quantized outer gradient: a payload of {payload.numel()} bytes for {n} elements; "
                          f"expected {payload_bytes(n, bits, block)}")
    values, s = payload[:nv], payload[nv:payload_bytes(n, bits, block)].clone().view(torch.float32)
    if bits == 8:
        q = values.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack([values & 0xF, values >> 4], dim=1).reshape(-1)[:n].to(torch.float32) - 8
    return (q * s.repeat_interleave(block)[:n]).to(dtype)


def chunks(n: int, parts: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` chunks of n elements, cut on block boundaries (some may be empty)."""
    blocks = -(-n // block)
    per = -(-blocks // parts)
    out = []
    for j in range(parts):
        a, b = min(n, j * per * block), min(n, (j + 1) * per * block)
        out.append((a, b - a))
    return out


def padded(sizes: list[int], block: int = BLOCK) -> int:
    """Elements on the wire for tensors of ``sizes``, each zero-padded to whole blocks."""
    return sum(-(-m // block) * block for m in sizes)


def pad(flat: torch.Tensor, sizes: list[int], block: int = BLOCK) -> torch.Tensor:
    """``flat`` (sum(sizes),) with each piece of ``sizes`` followed by zeros up to a whole block: (padded(sizes),)."""
    out = flat.new_zeros(padded(sizes, block))
    a = b = 0
    for m in sizes:
        out[b:b + m] = flat[a:a + m]
        a, b = a + m, b + -(-m // block) * block
    return out


def unpad(wide: torch.Tensor, sizes: list[int], block: int = BLOCK) -> torch.Tensor:
    """The inverse of :func:`pad`: the pieces without their padding, (sum(sizes),)."""
    out, b = [], 0
    for m in sizes:
        out.append(wide[b:b + m])
        b += -(-m // block) * block
    return torch.cat(out) if out else wide[:0]


@torch.no_grad()
def quantized_mean(flat: torch.Tensor, *, group, parts: int, rank: int, bits: int,
                   algorithm: str = "ring", sizes: list[int] | None = None) -> torch.Tensor:
    """Collective over ``group`` (``parts`` ranks; ``rank``: this rank's place in it): the mean of every
    rank's ``flat`` (n,), as decoded from the payloads (the same bits on every rank; module docstring).
    The all-to-all is the direct exchange (p2p); ``algorithm`` is the all-gather's (distrain.comm).
    ``sizes``: the lengths of ``flat``'s tensors, each of which starts a new block (module docstring; every
    rank of ``group`` gives the same); None: the blocks run across the whole vector."""
    if sizes is not None:
        if sum(sizes) != flat.numel():
            raise ConfigError(f"quantized outer gradient: tensor sizes summing to {sum(sizes)} for a vector of "
                              f"{flat.numel()} elements")
        return unpad(quantized_mean(pad(flat, sizes), group=group, parts=parts, rank=rank, bits=bits,
                                    algorithm=algorithm), sizes)
    n, dtype = flat.numel(), flat.dtype
    cuts = chunks(n, parts)
    send = [encode(flat[a:a + m], bits) for a, m in cuts]
    mine_a, mine_m = cuts[rank]
    got = torch.empty(parts * payload_bytes(mine_m, bits), dtype=torch.uint8)
    comm.all_to_all_single(got, torch.cat(send), [payload_bytes(mine_m, bits)] * parts,
                           [t.numel() for t in send], group=group, algorithm="p2p")
    size = payload_bytes(mine_m, bits)
    total = torch.zeros(mine_m, dtype=dtype)
    for i in range(parts):  # rank order: the sum's order is fixed
        total += decode(got[i * size:(i + 1) * size], mine_m, bits, dtype)
    total /= parts
    widest = max(payload_bytes(m, bits) for _, m in cuts)
    mine = torch.zeros(widest, dtype=torch.uint8)
    mine[:size] = encode(total, bits)
    gathered = [torch.empty(widest, dtype=torch.uint8) for _ in range(parts)]
    comm.all_gather(gathered, mine, group=group, algorithm=algorithm)
    return torch.cat([decode(g, m, bits, dtype) for g, (_, m) in zip(gathered, cuts)])


def sync_bytes(n: int, parts: int, bits: int) -> int:
    """Payload bytes one rank sends per sync (the all-to-all of the other ranks' chunks, then its padded
    chunk of the mean to each of the K − 1 others), for the cost model and the ledger's check. Rank 0's
    count: the all-gather is symmetric; the all-to-all depends on which chunk is one's own (the last may
    be short), so this is the count of a rank whose chunk is the first. With ``sizes`` (blocks per tensor),
    ``n`` is :func:`padded` (sizes)."""
    cuts = chunks(n, parts)
    widest = max(payload_bytes(m, bits) for _, m in cuts)
    return sum(payload_bytes(m, bits) for _, m in cuts[1:]) + (parts - 1) * widest


def error_bound(flats: list[torch.Tensor], bits: int) -> torch.Tensor:
    """Per element, the most :func:`quantized_mean` of ``flats`` (one per rank) may differ from their exact
    mean: half of each rank's first-round step, averaged, plus half of the second round's step."""
    K = len(flats)
    exact = sum(f.to(torch.float64) for f in flats) / K
    n = exact.numel()
    first = sum(scales_of(f, bits).repeat_interleave(BLOCK)[:n].to(torch.float64) for f in flats) / (2 * K)
    # the second round quantizes the decoded mean, whose absmax is at most the exact one's plus the first error
    step2 = (scales_of(exact.abs() + first, bits).repeat_interleave(BLOCK)[:n]).to(torch.float64) / 2
    return first + step2
