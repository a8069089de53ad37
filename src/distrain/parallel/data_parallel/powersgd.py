"""PowerSGD as a DDP communication hook (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019), written on
:mod:`distrain.comm` with torch's ``powerSGD_hook`` arithmetic, so that with the same summation
order the bits equal torch's (tests/test_ddp_hooks.py). The hook contract and the bucket are in
comm_hooks.py.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.data_parallel.comm_hooks import GradBucket, all_reduce_future, hook_group

class PowerSGDState:
    """PowerSGD's settings and memory, shared by every bucket of one model (torch's
    ``powerSGD_hook.PowerSGDState``: the same arguments, defaults and fields).

    ``matrix_approximation_rank`` r: each gradient matrix M (n x m) is sent as P (n x r) and
    Q (m x r) instead, (n + m) r numbers instead of n m. ``start_powerSGD_iter``: iterations
    before it all-reduce the plain gradient (the start of training is sensitive to gradient
    error); it must be at least 2 with error feedback or warm start, as in torch (torch DDP
    rebuilds its buckets after iteration 1, which would invalidate the memory).
    ``min_compression_rate``: a gradient, viewed as an n x m matrix (the first dimension by the
    rest), is compressed only if n m > (n + m) r times this; the others are all-reduced as they
    are, among them every vector (biases, norms) at any rate >= 1.
    ``use_error_feedback``: what compression lost this step is added to the next step's
    gradient. ``warm_start``: each step's power iteration starts from the previous step's Q.
    ``orthogonalization_epsilon``: added to the column norms (guards against a zero column).
    ``random_seed``: the initial Q's, drawn as torch draws them (the same numbers).
    ``batch_tensors_with_same_shape``: compress same-shaped matrices of a bucket in one
    batched product. ``process_group``: None means the DDP's group.
    ``compression_stats_logging_frequency`` is accepted for torch's signature; the counts are
    kept (:meth:`compression_stats`) but not logged.

    Memory per bucket index: ``error_dict`` (the error feedback, the bucket's length),
    ``p_memory_dict`` / ``q_memory_dict`` (every compressed matrix's P and Q, back to back).
    ``iter`` counts backward passes (on the last bucket).
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False):
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ConfigError(f"PowerSGDState: start_powerSGD_iter must be at least 2 with error feedback or warm "
                              f"start (DDP's buckets settle after the first iteration), got {start_powerSGD_iter}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.rng = np.random.RandomState(random_seed)  # seeds for the initial Q's, as torch's
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """One more iteration once the last bucket of a backward pass is handled."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(numbers before / numbers after, numbers before, numbers after) over all compressed steps."""
        after = self.total_numel_after_compression
        return (self.total_numel_before_compression / after if after else 0,
                self.total_numel_before_compression, after)


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Make the columns of each matrix of the batch ``matrices`` (b x n x r) orthonormal, in place.

    Gram-Schmidt for rank <= 2 (and half precision, which QR does not take), torch's QR
    above, as torch's PowerSGD chooses. A zero column gives NaNs unless ``epsilon`` > 0.
    """
    rank = matrices.shape[2]
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(matrices, out=(matrices, torch.empty(matrices.shape[0], rank, rank, dtype=matrices.dtype,
                                                             device=matrices.device)))
        return
    for i in range(rank):
        col = matrices[:, :, i:i + 1]
        if epsilon == 0:
            col /= torch.norm(col, dim=1, keepdim=True)
        else:
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < rank:  # remove this column's direction from the columns after it
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """PowerSGD: all-reduce a rank-r approximation of each gradient matrix instead of the matrix.

    Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019 (arXiv:1905.13727), Algorithm 1, as torch's
    ``powerSGD_hook`` implements it. For each bucket, with M one parameter's gradient viewed as
    an n x m matrix (the first dimension by the rest):

    0. Before ``state.start_powerSGD_iter``: the plain average (:func:`allreduce_hook`).
    1. Error feedback: M += the error this rank's compression left last step.
    2. Matrices that compress well enough (``min_compression_rate``) are compressed; the rest
       (vectors among them, at any rate >= 1) are concatenated, summed and divided by P.
    3. Q (m x r): last step's Q (warm start), or random normal the first time; orthogonalized.
    4. P = M Q on every rank; the Ps are summed over the group (one all-reduce for the bucket).
    5. P is orthogonalized (Gram-Schmidt); Q = M^T P; the Qs are summed and divided by P
       (ranks), so P Q^T = P P^T mean(M): the projection of the averaged gradient on span(P).
    6. M := P Q^T, in the bucket; the error is what this rank had minus what it now holds.

    Same-shaped matrices are handled together (``batch_tensors_with_same_shape``) or one by one,
    grouped by shape as torch does: that order decides the layout of P and Q and which random
    numbers each initial Q gets. The three all-reduces use the DDP's algorithm. They run one
    after the other before the hook returns (the future is already complete): step 5 needs
    step 4's sum, and issuing it from a completion callback would let ranks issue a bucket's
    collectives in different orders relative to the next bucket's.
    """
    group = hook_group(state.process_group, bucket)
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:  # 0. plain averaging first
        state.maybe_increase_iter(bucket)
        grad.div_(world)
        return all_reduce_future(grad, group, bucket.algorithm)

    i = bucket.index()
    if state.use_error_feedback:  # 1. compress gradient + last step's error
        if i in state.error_dict:
            grad.add_(state.error_dict[i])
        else:
            state.error_dict[i] = torch.zeros_like(grad)
        before = grad.detach().clone()

    compressed, plain = _split(state, bucket.gradients())  # 2.
    plain_flat = torch.cat([t.view(-1) for t in plain]) if plain else grad.new_empty(0)

    by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    for m in compressed:
        by_shape[m.shape].append(m)
    batches = []  # each b x n x m: one matrix, or a stack of same-shaped ones
    for same in by_shape.values():
        if state.batch_tensors_with_same_shape:
            batches.append(same[0].unsqueeze(0) if len(same) == 1 else torch.stack(same))
        else:
            batches.extend(m.unsqueeze(0) for m in same)
    ranks = [min(n, m, state.matrix_approximation_rank) for _, n, m in (b.shape for b in batches)]

    fresh = not state.warm_start or i not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[i] = grad.new_empty(sum(b.shape[0] * b.shape[1] * r for b, r in zip(batches, ranks)))
        state.q_memory_dict[i] = grad.new_empty(sum(b.shape[0] * b.shape[2] * r for b, r in zip(batches, ranks)))
    ps = _views(state.p_memory_dict[i], [(b.shape[0], b.shape[1], r) for b, r in zip(batches, ranks)])
    qs = _views(state.q_memory_dict[i], [(b.shape[0], b.shape[2], r) for b, r in zip(batches, ranks)])

    if fresh:  # 3. random Q, from torch's seed sequence
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=grad.dtype))
                _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)

    for b, q, p in zip(batches, qs, ps):  # 4. P = M Q, summed
        torch.bmm(b, q, out=p)
    _sum(plain_flat, group, bucket.algorithm)
    plain_flat.div_(world)
    off = 0
    for t in plain:
        t.copy_(plain_flat[off:off + t.numel()].view_as(t))
        off += t.numel()
    _sum(state.p_memory_dict[i], group, bucket.algorithm)

    for p in ps:  # 5. orthogonal P; Q = M^T P, averaged
        _orthogonalize(p, state.orthogonalization_epsilon)
    for b, p, q in zip(batches, ps, qs):
        torch.bmm(b.transpose(1, 2), p, out=q)
    _sum(state.q_memory_dict[i], group, bucket.algorithm)
    state.q_memory_dict[i].div_(world)

    for p, q, b in zip(ps, qs, batches):  # 6. M = P Q^T
        torch.bmm(p, q.transpose(1, 2), out=b)
    if state.batch_tensors_with_same_shape:  # a stack is a copy: back into the bucket
        for b in batches:
            if b.shape[0] > 1:
                for dst, src in zip(by_shape[b.shape[1:]], b):
                    dst.copy_(src)
    if state.use_error_feedback:
        state.error_dict[i] = before - grad
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grad)
    return done


powerSGD_hook = powersgd_hook  # torch's spelling


def _split(state: PowerSGDState, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients worth compressing, as n x m matrix views (the first dimension by the rest),
    and the rest as they are, counting numbers before and after compression in ``state``.

    A vector is an n x 1 matrix: (n + 1) r * rate < n fails for any rate >= 1 (the default is
    2), so vectors go uncompressed; torch applies the same test to them, and so do we."""
    compressed, plain = [], []
    for t in grads:
        if t.dim() == 0 or t.numel() == 0:  # no matrix to speak of
            plain.append(t)
            state.total_numel_before_compression += t.numel()
            state.total_numel_after_compression += t.numel()
            continue
        matrix = t.view(t.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            compressed.append(matrix)
            state.total_numel_after_compression += (n + m) * r
        else:
            plain.append(t)
            state.total_numel_after_compression += n * m
    return compressed, plain


def _views(memory: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shapes:
        k = s[0] * s[1] * s[2]
        out.append(memory[off:off + k].view(s))
        off += k
    return out


def _sum(tensor: torch.Tensor, group, algorithm: str) -> None:
    if tensor.numel():  # every rank's bucket has the same layout: all skip an empty one alike
        comm.all_reduce(tensor, op="sum", group=group, algorithm=algorithm)
