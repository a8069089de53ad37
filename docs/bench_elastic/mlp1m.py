"""A 1.27 M-parameter MLP and random classification data (factories for --model/--data): the job of
`distrain bench elastic` in docs/fault_tolerance.md ("Measured"), run from this folder as mlp1m:mlp, mlp1m:data."""
import torch
import torch.nn as nn


def mlp():
    return nn.Sequential(nn.Linear(600, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256),
                         nn.ReLU(), nn.Linear(256, 10))


class Data:
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 600, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def get_batch(self, idx):
        return self.x[idx], self.y[idx]


def data():
    return Data(4096, 0), Data(512, 1)
