"""Groups as the tutorials make them: dist.new_group(ranks) called on every rank, then every
rank calls the collective with the group, members take part and the others do nothing
(torch's rule). Ranks split into evens and odds; 3+ ranks."""

import torch
from tutorial_dist import dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
evens = dist.new_group(list(range(0, world, 2)))
odds = dist.new_group(list(range(1, world, 2)))
RESULT = {}

for name, g in (("evens", evens), ("odds", odds)):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=g)  # a no-op on the ranks outside g
    RESULT[f"all_reduce_{name}"] = t.tolist()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=1 if name == "odds" else 0, group=g)
    RESULT[f"broadcast_{name}"] = b.tolist()

mine = evens if rank % 2 == 0 else odds
RESULT["group_ranks"] = dist.get_process_group_ranks(mine)
RESULT["group_rank"] = dist.get_rank(mine)
dist.barrier()
dist.destroy_process_group()
