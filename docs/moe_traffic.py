"""The expert-parallel traffic table of docs/moe.md: one training step of llama-moe-tiny per layout.

    .venv/bin/python docs/moe_traffic.py

Float32, initial weights (seed 0), a batch of 32 x 32 tokens (seed 3) split over P data ranks; prints,
for each (P, ep), rank 0's bytes by ledger label (``ep-all-to-all``, ``ep-counts``), the formula
(``distrain.parallel.expert_parallel.ep_bytes``) from the routing the routers made (captured from each
gate's output), and the busiest rank's all-to-all bytes.
"""

import torch
import torch.distributed as dist
import distrain
from distrain import comm
from distrain.models import build_model, lm_loss
from distrain.models.moe import MoEFeedForward, route
from distrain.models.registry import model_ep_plan
from distrain.parallel import parallelize
from distrain.parallel.expert_parallel import ep_bytes
from distrain.topology import Topology


def rank_fn(rank, world, ep):
    torch.manual_seed(0)
    net = build_model("llama-moe-tiny")
    topo = Topology.from_world(dp=world, ep=ep)
    pm = parallelize(net, topo, loss_fn=lm_loss, ep_plan=model_ep_plan(net))
    per = 4 // ep
    routed = []
    for m in net.modules():
        if isinstance(m, MoEFeedForward):
            def hook(g, i, out, cfg=m.moe):
                ids = route(out.detach(), cfg)[0]
                mine = torch.bincount(ids.reshape(-1) // per, minlength=ep)
                allr = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(allr, mine)
                routed.append(torch.stack(allr))
            m.gate.register_forward_hook(hook)
    ids = torch.randint(0, 256, (32, 33), generator=torch.Generator().manual_seed(3))
    b = 32 // world
    x, y = ids[rank * b:(rank + 1) * b, :-1], ids[rank * b:(rank + 1) * b, 1:]
    with comm.ledger() as led:
        pm.train_step(x, y)
    out = {lab: led.get(lab, kind).bytes_sent for lab, kind in
           (("ep-all-to-all", "p2p"), ("ep-counts", "p2p"))}

    # formula: per ep group (consecutive blocks of ep ranks)
    g = rank // ep
    formula = 0
    for m in routed:
        sub = m[g * ep:(g + 1) * ep]  # rows: ranks of my ep group; columns: ep ranks
        formula += ep_bytes(sub, 64, 4)[rank % ep]["sent"]
    out["formula"] = formula
    return out


if __name__ == "__main__":
    for world, ep in ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4)):
        res = distrain.spawn(rank_fn, world, args=(world, ep), timeout=120)
        print(f"P={world} ep={ep}", res[0], "max ep bytes", max(r["ep-all-to-all"] for r in res), flush=True)
