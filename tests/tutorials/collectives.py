"""The collectives walked through in the seeds (broadcast, reduce SUM/MAX, scatter, gather,
all_reduce, all_gather, reduce_scatter) and torch's all_to_all, with the tutorials' inputs
(rank-dependent tensors, rank 0 as root), on any world size. RESULT holds every output."""

import torch
from tutorial_dist import dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
RESULT = {}

t = torch.randn(2, 2, generator=torch.Generator().manual_seed(7)) if rank == 0 else torch.zeros(2, 2)
dist.broadcast(t, src=0)
RESULT["broadcast"] = t.tolist()

for name, op in (("reduce_sum", dist.ReduceOp.SUM), ("reduce_max", dist.ReduceOp.MAX)):
    t = torch.ones(2, 2) * (rank + 1)
    dist.reduce(t, op=op, dst=0)
    RESULT[name] = t.tolist() if rank == 0 else None

out = torch.zeros(1)
if rank == 0:
    inputs = torch.tensor([10.0 * (i + 1) for i in range(world)])
    dist.scatter(out, scatter_list=list(inputs.split(1)), src=0)
else:
    dist.scatter(out, src=0)
RESULT["scatter"] = out.tolist()

inp = torch.tensor([float(rank)])
if rank == 0:
    outs = [torch.zeros(1) for _ in range(world)]
    dist.gather(inp, gather_list=outs, dst=0)
    RESULT["gather"] = [o.item() for o in outs]
else:
    dist.gather(inp, dst=0)

t = torch.ones(2, 2) * rank
dist.all_reduce(t, op=dist.ReduceOp.SUM)
RESULT["all_reduce"] = t.tolist()

outs = [torch.zeros(3) for _ in range(world)]
dist.all_gather(outs, torch.arange(3.0) + 100 * rank)
RESULT["all_gather"] = [o.tolist() for o in outs]

ins = [torch.full((2,), float(rank * world + j)) for j in range(world)]
out = torch.zeros(2)
dist.reduce_scatter(out, ins, op=dist.ReduceOp.SUM)
RESULT["reduce_scatter"] = out.tolist()

ins = [torch.full((2,), float(10 * rank + j)) for j in range(world)]  # block j goes to rank j
outs = [torch.zeros(2) for _ in range(world)]
dist.all_to_all(outs, ins)  # (Gloo's list form needs equal sizes)
RESULT["all_to_all"] = [o.tolist() for o in outs]

# uneven blocks: rank r sends j + 1 rows to rank j, so rank r receives r + 1 rows from each
inp = torch.cat([torch.full((j + 1, 2), float(10 * rank + j)) for j in range(world)])
out = torch.zeros(world * (rank + 1), 2)
dist.all_to_all_single(out, inp, output_split_sizes=[rank + 1] * world,
                       input_split_sizes=[j + 1 for j in range(world)])
RESULT["all_to_all_single"] = out.tolist()

objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "name": f"worker-{rank}"})
RESULT["all_gather_object"] = objs

dist.destroy_process_group()
