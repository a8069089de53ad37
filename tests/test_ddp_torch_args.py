"""Our DDP takes torch DDP's constructor arguments with torch's meaning: BatchNorm buffers
broadcast before each forward (running stats equal to torch DDP's, rank by rank, step by
step), gradients as bucket views, static_graph, process_group; clear errors for the rest."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distrain
from distrain.errors import ConfigError
from distrain.parallel.data_parallel import DistributedDataParallel

STEPS, LOCAL_B = 4, 5


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(300 + 10 * step + rank)
    # every rank its own data with its own mean, so unsynchronized running stats would drift apart
    return torch.randn(LOCAL_B, 6, generator=g, dtype=torch.float64) + rank, torch.randint(0, 3, (LOCAL_B,),
                                                                                           generator=g)


def _buffers(m: nn.Module) -> torch.Tensor:
    return torch.cat([b.double().reshape(-1) for b in m.buffers()])


def _bn_vs_torch(rank: int, flag: str, value) -> dict:
    kw = {flag: value} if flag else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates broadcast_buffers
        ours = DistributedDataParallel(_bn_model(), algorithm="ring", **kw)
        theirs = nn.parallel.DistributedDataParallel(_bn_model(), **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    bad = []
    for s in range(STEPS):
        x, y = _batch(s, rank)
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        if not torch.allclose(_buffers(ours.module), _buffers(theirs.module), rtol=1e-12, atol=1e-14):
            bad.append(f"rank {rank} step {s}: running stats differ from torch DDP's")
        for (n, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
            if not torch.allclose(p, q, rtol=1e-10, atol=1e-12):
                bad.append(f"rank {rank} step {s}: {n} differs from torch DDP's")
    for m in (ours, theirs):  # an evaluation forward: buffers synced first (the last forward had grad)
        m.eval()
        with torch.no_grad():
            m(_batch(0, rank)[0])
    rows = [torch.empty_like(_buffers(ours.module)) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, _buffers(ours.module))
    return {"bad": bad, "same_as_torch": torch.allclose(_buffers(ours.module), _buffers(theirs.module),
                                                        rtol=1e-12, atol=1e-14),
            "equal_across_ranks": all(torch.equal(r, rows[0]) for r in rows)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flag,value,synced", [
    (None, None, True),                      # the default: broadcast before each forward
    ("broadcast_buffers", False, False),     # each rank keeps its own running stats
    ("forward_sync_buffers", True, True),
])
def test_batchnorm_running_stats_as_torch_ddp(flag, value, synced):
    res = distrain.spawn(_bn_vs_torch, 3, args=(flag, value), timeout=150)
    bad = [b for r in res for b in r["bad"]]
    assert not bad, "\n".join(bad)
    assert all(r["same_as_torch"] for r in res)
    assert all(r["equal_across_ranks"] == synced for r in res)


def _bucket_views(rank: int) -> list[str]:
    runs = {}
    for view in (False, True):
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double(),
                                        process_group=dist.group.WORLD, algorithm="tree", bucket_cap_mb=1e-4,
                                        gradient_as_bucket_view=view, batched_grad_copy=view)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for s in range(STEPS):
            x, y = _batch(s, rank)
            opt.zero_grad(set_to_none=(s % 2 == 0))  # both ways of zeroing
            F.cross_entropy(model(x), y).backward()
            opt.step()
        inside = [any(p.grad.data_ptr() == v.data_ptr() for b in model._buckets for v in b.views)
                  for p in model.module.parameters()]
        runs[view] = ([p.detach().clone() for p in model.module.parameters()], inside)
    bad = []
    if not all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0])):
        bad.append(f"rank {rank}: gradient_as_bucket_view changes the result")
    if any(runs[False][1]) or not all(runs[True][1]):
        bad.append(f"rank {rank}: grads in buckets: {runs[False][1]} (copies) / {runs[True][1]} (views)")
    return bad


@pytest.mark.timeout(120)
def test_gradient_as_bucket_view_and_batched_copy():
    assert distrain.spawn(_bucket_views, 2, timeout=90) == [[], []]


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _args(rank: int) -> list[str]:
    errs = []
    cases = [
        (dict(device_ids=[0]), "device_ids and output_device only apply to a module on one accelerator; this "
                               "module's parameters are on ['cpu']"),
        (dict(output_device=0), "pass device_ids=None, output_device=None"),
        (dict(device_ids=[0, 1]), "device_ids can only be None or contain a single element"),
        (dict(mixed_precision=object()), "use compression='bf16' or 'fp16'"),
        (dict(device_mesh=object()), "device_mesh="),
        (dict(skip_all_reduce_unused_params=True), "skip_all_reduce_unused_params=True is not supported by "
                                                   "distrain's DDP; leave it at False"),
        (dict(bucket_cap_mb_list=[1, 2]), "bucket_cap_mb_list=[1, 2] is not supported"),
        (dict(delay_all_reduce_named_params=[]), "delay_all_reduce_named_params=[] is not supported"),
        (dict(process_group=dist.group.WORLD, group=dist.new_group([0, 1])), "pass the group once"),
        (dict(dim=1.5), "dim must be an int"),
    ]
    for kw, frag in cases:
        try:
            DistributedDataParallel(nn.Linear(2, 2), **kw)
            errs.append(f"{kw} accepted")
        except ConfigError as e:
            if frag not in str(e):
                errs.append(f"{kw}: {e}")
    with pytest.warns(FutureWarning, match="check_reduction is deprecated"):
        DistributedDataParallel(nn.Linear(2, 2), check_reduction=True)
    # static_graph: the same parameters unused every step is fine (as in torch), zeros are averaged
    model = DistributedDataParallel(_Branchy(), None, None, 0, None, True, dist.group.WORLD, 25, False, False,
                                    False, True)  # torch's positional order: static_graph is the 12th
    model(torch.ones(2, 4)).sum().backward()
    if not (model.static_graph and torch.equal(model.module.unused.weight.grad, torch.zeros(2, 4))):
        errs.append("static_graph=True: unused parameter not handled")
    return errs


@pytest.mark.timeout(60)
def test_torch_arguments_and_clear_errors():
    assert distrain.spawn(_args, 2, timeout=45) == [[], []]
