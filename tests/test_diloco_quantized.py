"""DiLoCo's outer gradient in 8 and 4 bits (distrain.parallel.diloco.quantized).

* encode/decode: exact payload sizes, values on the grid come back bit for bit, 4-bit packing of odd
  lengths, all-zero blocks, a short payload refused;
* the quantized mean over 3 ranks (n not divisible by the blocks or the ranks): every rank gets the same
  bits, equal to a one-process reference of the same steps, within the documented error bound of the exact
  mean, and the ledger's bytes are exactly :func:`sync_bytes`;
* a trained run with --outer-compression int8/int4: the ledger's bytes per step are the model's, and the
  losses stay near the uncompressed run's.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_ranks, train_losses, trainer_config
from distrain.errors import ConfigError
from distrain.parallel.diloco import quantized as qz

N = 1000  # 8 blocks of 128 minus 24: the last block short; chunks of 3, 3, 2 blocks over 3 ranks
SIZES = [300, 1, 129, 0, 570]  # N as tensors (grid islands: a block never mixes two): 3 + 1 + 2 + 0 + 5 blocks


def grid(n: int, bits: int, seed: int) -> torch.Tensor:
    """Values exactly on the quantization grid: integers in [-qmax, qmax] with a block's absmax hit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-qz.qmax(bits), qz.qmax(bits) + 1, (n,), generator=g).float()
    q[::qz.BLOCK] = qz.qmax(bits)  # every block's absmax is qmax: its scale is exactly the power of two below
    return q * 2.0 ** -5


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 127, 128, 129, 1001])
def test_encode_decode_sizes_and_exact_grid_values(bits, n):
    x = grid(n, bits, n)
    p = qz.encode(x, bits)
    assert p.dtype == torch.uint8 and p.numel() == qz.payload_bytes(n, bits)
    assert p.numel() == (n * bits + 7) // 8 + 4 * (-(-n // 128))
    assert torch.equal(qz.decode(p, n, bits, torch.float32), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_error_within_half_a_step_and_zero_blocks(bits):
    x = torch.randn(700, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[128:256] = 0  # an all-zero block decodes to zeros (its scale is 1, never 0)
    y = qz.decode(qz.encode(x, bits), x.numel(), bits, torch.float64)
    step = qz.scales_of(x, bits).repeat_interleave(128)[:700].double()
    assert torch.all((y - x).abs() <= step / 2 * (1 + 1e-6))
    assert torch.equal(y[128:256], torch.zeros(128, dtype=torch.float64))


def test_a_short_payload_is_refused():
    p = qz.encode(torch.ones(300), 8)
    with pytest.raises(ConfigError, match="a payload of 303 bytes for 300 elements; expected 312"):
        qz.decode(p[:303], 300, 8, torch.float32)


def test_pad_puts_each_tensor_on_whole_blocks_and_unpad_undoes_it():
    x = torch.arange(1, N + 1, dtype=torch.float64)
    wide = qz.pad(x, SIZES)
    assert qz.padded(SIZES) == wide.numel() == 11 * 128
    assert [wide[b].item() for b in (0, 299, 300, 384, 385, 512, 640, 641, 768)] == [1, 300, 0, 301, 0, 302, 430, 0, 431]
    assert torch.equal(qz.unpad(wide, SIZES), x)
    with pytest.raises(ConfigError, match="tensor sizes summing to 999 for a vector of 1000 elements"):
        qz.quantized_mean(x, group=None, parts=1, rank=0, bits=8, sizes=[999])


def test_chunks_cover_the_vector_on_block_boundaries():
    assert qz.chunks(N, 3) == [(0, 384), (384, 384), (768, 232)]
    assert qz.chunks(100, 3) == [(0, 100), (100, 0), (100, 0)]  # one block: the others own nothing


def reference_mean(flats: list[torch.Tensor], bits: int) -> torch.Tensor:
    """The quantized mean's steps in one process: per chunk, decode every rank's encoding and add them in
    rank order, divide by K, encode and decode again."""
    K, n = len(flats), flats[0].numel()
    out = []
    for a, m in qz.chunks(n, K):
        total = torch.zeros(m, dtype=flats[0].dtype)
        for f in flats:
            total += qz.decode(qz.encode(f[a:a + m], bits), m, bits, f.dtype)
        total /= K
        out.append(qz.decode(qz.encode(total, bits), m, bits, f.dtype))
    return torch.cat(out)


def flat_of(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(10 + rank)) * (rank + 1)


def _mean_on_ranks(rank: int) -> list[str]:
    import torch.distributed as dist

    from distrain import comm

    K, bad = dist.get_world_size(), []
    for bits in (8, 4):
        with comm.ledger() as led:
            got = qz.quantized_mean(flat_of(rank), group=None, parts=K, rank=rank, bits=bits)
        sent = led.bytes_sent()
        flats = [flat_of(r) for r in range(K)]
        if not torch.equal(got, reference_mean(flats, bits)):
            bad.append(f"{bits} bits: differs from the one-process reference")
        exact = sum(f.double() for f in flats) / K
        over = (got.double() - exact).abs() - qz.error_bound(flats, bits) * (1 + 1e-6)
        if over.max() > 0:
            bad.append(f"{bits} bits: {int((over > 0).sum())} elements outside the error bound")
        if rank == 0 and sent != qz.sync_bytes(N, K, bits):
            bad.append(f"{bits} bits: rank 0 sent {sent} bytes, not {qz.sync_bytes(N, K, bits)}")
        every = [torch.empty_like(got) for _ in range(K)]
        dist.all_gather(every, got)
        if not all(torch.equal(e, got) for e in every):
            bad.append(f"{bits} bits: the ranks' means differ")
        # blocks per tensor (grid islands): each piece of SIZES quantized on its own, padded to whole blocks
        with comm.ledger() as led:
            got = qz.quantized_mean(flat_of(rank), group=None, parts=K, rank=rank, bits=bits, sizes=SIZES)
        sent, want, a = led.bytes_sent(), [], 0
        for m in SIZES:
            want.append(reference_mean([f[a:a + m] for f in flats], bits))
            a += m
        if not torch.equal(got, torch.cat(want)):
            bad.append(f"{bits} bits, per tensor: differs from the pieces' one-process references")
        if torch.equal(got, reference_mean(flats, bits)):
            bad.append(f"{bits} bits, per tensor: the same as blocks across the vector (the sizes were ignored)")
        if rank == 0 and sent != qz.sync_bytes(qz.padded(SIZES), K, bits):
            bad.append(f"{bits} bits, per tensor: rank 0 sent {sent} bytes, not "
                       f"{qz.sync_bytes(qz.padded(SIZES), K, bits)}")
    return bad


@pytest.mark.timeout(90)
def test_the_quantized_mean_of_three_ranks():
    run_ranks(_mean_on_ranks, 3, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compressed_runs_send_the_models_bytes_and_train_near_float32(tmp_path):
    from distrain.models import build_model

    n = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    base = dict(strategy="diloco", nproc=3, inner_steps=3, steps=12, batch_size=12, dtype="float32")
    losses = {}
    for comp in (None, "int8", "int4"):
        out = tmp_path / f"run-{comp}"
        losses[comp] = train_losses(trainer_config(out, outer_compression=comp, **base))
        if comp:
            s = json.loads((out / "summary.json").read_text())
            assert s["outer_syncs"] == 4
            assert s["bytes_sent_per_step_rank0"] * 12 == 4 * qz.sync_bytes(n, 3, qz.BITS[comp])
    # the last sync's rounding moves the last steps' losses by little against float32's
    for comp in ("int8", "int4"):
        assert losses[comp][:3] == losses[None][:3]  # before the first sync: the same inner steps
        assert abs(losses[comp][-1] - losses[None][-1]) < 0.02 * losses[None][-1], (comp, losses)
