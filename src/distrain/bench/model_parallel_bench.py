"""``distrain bench pipeline`` and ``distrain bench tp``: the model-parallel measurements.

* ``bench pipeline``: the measured bubble fraction of GPipe and 1F1B against
  (p-1)/(m+p-1), and each stage's peak of micro-batches held, on a synthetic pipeline of
  equal-cost stages (distrain.parallel.pipeline_timeline.measure_bubbles).
* ``bench tp``: one forward and one backward of a tensor-parallel GPT under the traffic
  ledger; the all-reduce payload per transformer block against Megatron's count (two
  all-reduces of b*s*h elements forward, two backward, per block; Shoeybi et al. 2019).
"""

from __future__ import annotations

import argparse
import json

import torch

from distrain.bench.common import parse_choices, parse_ints
from distrain.errors import ConfigError


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", default="2,4", help="pipeline sizes")
    p.add_argument("--microbatches", "--m", dest="m", default="1,2,4,8", help="micro-batch counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--workload", default="spin", help="spin (busy CPU) or sleep (idle CPU) stage cost")
    p.add_argument("--json", default=None)


def run_pipeline(args: argparse.Namespace) -> int:
    from distrain.parallel.pipeline_timeline import format_bubble_table, measure_bubbles

    workload = parse_choices(args.workload, ("spin", "sleep"), "--workload")[0]
    rows = measure_bubbles(parse_ints(args.pp, "--pp", 2), parse_ints(args.m, "--m"), repeats=args.repeats,
                           workload=workload)
    print(format_bubble_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--algorithm", default="ring", help="star, ring or tree (native traffic is not visible)")


def _tp_rank(rank: int, model: str, b: int, algorithm: str) -> dict:
    import torch.distributed as dist

    from distrain import comm
    from distrain.models import build_model
    from distrain.parallel.tensor import apply_tensor_parallel, tp_loss

    torch.manual_seed(0)
    gpt = apply_tensor_parallel(build_model(model), dist.group.WORLD, algorithm)
    T = gpt.config.block_size
    ids = torch.randint(0, gpt.config.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(1))
    with comm.ledger() as fwd:
        loss = tp_loss(gpt(ids[:, :-1]), ids[:, 1:], dist.group.WORLD, algorithm)
    with comm.ledger() as bwd:
        loss.backward()
    return {k: (led.get("all_reduce", algorithm).calls, led.get("all_reduce", algorithm).payload_bytes)
            for k, led in (("forward", fwd), ("backward", bwd))}


def run_tp(args: argparse.Namespace) -> int:
    from distrain.launch import spawn
    from distrain.models import preset_config
    from distrain.parallel.tensor import megatron_bytes_per_block, tp_all_reduces_per_step

    if args.algorithm not in ("star", "ring", "tree"):
        raise ConfigError("--algorithm must be star, ring or tree: the ledger cannot see inside native calls")
    c = preset_config(args.model)
    b, s, h, L = args.batch_size, c["block_size"], c["n_embd"], c["n_layer"]
    got = spawn(_tp_rank, args.tp, args=(args.model, b, args.algorithm))[0]
    want = tp_all_reduces_per_step(L, b, s, h, 4)
    per_block = megatron_bytes_per_block(b, s, h, 4)
    print(f"{args.model}: b={b} s={s} h={h}, {L} blocks, tp={args.tp}, fp32; all-reduce payload per rank, one step")
    print("| pass | calls (ledger) | bytes (ledger) | expected calls | expected bytes | of which blocks "
          "| per block (ledger) | Megatron per block: 2 x b*s*h*4 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for k, per in (("forward", per_block.forward), ("backward", per_block.backward)):
        calls, nbytes = got[k]
        other = sum(n for site, n in want[k] if not site.startswith("block"))
        exp_calls, exp_bytes = len(want[k]), sum(n for _, n in want[k])
        ok &= (calls, nbytes) == (exp_calls, exp_bytes)
        print(f"| {k} | {calls} | {nbytes:,} | {exp_calls} | {exp_bytes:,} | {nbytes - other:,} "
              f"| {(nbytes - other) // L:,} | {per:,} |")
    print("ledger equals Megatron's count exactly" if ok else "MISMATCH between the ledger and the count")
    return 0 if ok else 1
