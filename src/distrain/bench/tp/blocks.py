"""``distrain bench tp``: one forward and one backward of a tensor-parallel GPT under the traffic
ledger; the all-reduce payload per transformer block against Megatron's count (two
all-reduces of b*s*h elements forward, two backward, per block; Shoeybi et al. 2019); then the
activation bytes one block keeps for backward per rank, in one process, under tensor
parallelism, and under tensor + sequence parallelism (Korthikanti et al. 2022), measured with
autograd's saved-tensor hooks. The command line (distrain/cli/bench.py) parses the flags and
calls :func:`run`.
"""

from __future__ import annotations

import torch

from distrain.errors import ConfigError


def _tp_rank(rank: int, model: str, b: int, algorithm: str) -> dict:
    import torch.distributed as dist

    from distrain import comm
    from distrain.models import build_model
    from distrain.models.gpt.plan import gpt_tp_plan
    from distrain.parallel.tensor_parallel import apply_tensor_parallel, tp_loss

    torch.manual_seed(0)
    gpt = apply_tensor_parallel(build_model(model), dist.group.WORLD, algorithm, plan=gpt_tp_plan())
    T = gpt.config.block_size
    ids = torch.randint(0, gpt.config.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(1))
    with comm.ledger() as fwd:
        loss = tp_loss(gpt(ids[:, :-1]), ids[:, 1:], dist.group.WORLD, algorithm)
    with comm.ledger() as bwd:
        loss.backward()
    out = {k: (led.get("all_reduce", algorithm).calls, led.get("all_reduce", algorithm).payload_bytes)
           for k, led in (("forward", fwd), ("backward", bwd))}
    C, P = gpt.config.n_embd, dist.get_world_size()
    for name, plan in (("tensor parallel", gpt_tp_plan()), ("tensor + sequence parallel",
                                                             gpt_tp_plan(sequence_parallel=True))):
        torch.manual_seed(0)
        block = apply_tensor_parallel(build_model(model), dist.group.WORLD, algorithm, plan=plan).layers[1]
        rows = T // P if "sequence" in name else T
        out[name] = saved_activation_bytes(block, torch.randn(b, rows, C))
    torch.manual_seed(0)
    out["one process"] = saved_activation_bytes(build_model(model).layers[1], torch.randn(b, T, C))
    return out


def run(tp: int, model: str, batch_size: int, algorithm: str) -> int:
    """``distrain bench tp``: print both tables; 0 when the ledger equals Megatron's count, else 1."""
    from distrain.launch import spawn
    from distrain.models import preset_config
    from distrain.models.gpt.plan import tp_all_reduces_per_step
    from distrain.parallel.tensor_parallel import megatron_bytes_per_block

    if algorithm not in ("star", "ring", "tree"):
        raise ConfigError("--algorithm must be star, ring or tree: the ledger cannot see inside native calls")
    c = preset_config(model)
    b, s, h, L = batch_size, c["block_size"], c["n_embd"], c["n_layer"]
    got = spawn(_tp_rank, tp, args=(model, b, algorithm))[0]
    want = tp_all_reduces_per_step(L, b, s, h, 4)
    per_block = megatron_bytes_per_block(b, s, h, 4)
    print(f"{model}: b={b} s={s} h={h}, {L} blocks, tp={tp}, fp32; all-reduce payload per rank, one step")
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
    print(f"\nactivations one block keeps for backward, per rank (b={b}, s={s}, h={h}, fp32; b*s*h*4 = "
          f"{b * s * h * 4:,} bytes)")
    print("| layout | bytes per rank | / (b*s*h*4) | / one process |")
    print("|---|---:|---:|---:|")
    for name in ("one process", "tensor parallel", "tensor + sequence parallel"):
        print(f"| {name} | {got[name]:,} | {got[name] / (b * s * h * 4):.2f} | {got[name] / got['one process']:.3f} |")
    return 0 if ok else 1


def saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during ``module(x)`` (each storage counted once; the
    parameters, which exist anyway, not counted): the activation memory of one forward."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.requires_grad_())
    return sum(seen.values())
