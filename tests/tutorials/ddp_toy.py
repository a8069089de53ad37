"""The PyTorch DDP tutorial's ToyModel (Linear(10,10) -> ReLU -> Linear(10,5)), trained three
ways for a few steps in float64, each rank on its own batch:

1. torch's DistributedDataParallel on the process group this script initialised;
2. by hand as in "Writing Distributed Applications with PyTorch": parameters broadcast from
   rank 0 (on nn.Parameter leaves, outside no_grad: the call that used to hang), gradients
   summed with dist.all_reduce and divided by the world size;
3. the parameters all-reduced directly (an average of models), again on leaves.

RESULT: the parameters after training (equal on every rank, and to torch's run)."""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tutorial_dist import dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def batch(step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)


RESULT = {}
torch.manual_seed(0)
model = DDP(ToyModel())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    x, y = batch(step)
    opt.zero_grad()
    nn.MSELoss()(model(x), y).backward()
    opt.step()
RESULT["ddp"] = [p.detach().tolist() for p in model.parameters()]

torch.manual_seed(rank)  # different on purpose: the broadcast must make them equal
model = ToyModel()
for p in model.parameters():
    dist.broadcast(p, src=0)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    x, y = batch(step)
    opt.zero_grad()
    nn.MSELoss()(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    opt.step()
RESULT["by_hand"] = [p.detach().tolist() for p in model.parameters()]

for p in model.parameters():
    dist.all_reduce(p, op=dist.ReduceOp.SUM)
    with torch.no_grad():
        p /= world
RESULT["averaged"] = [p.detach().tolist() for p in model.parameters()]
dist.destroy_process_group()
