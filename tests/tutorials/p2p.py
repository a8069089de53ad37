"""Point-to-point, as in the seeds' large-scale-lm chapter (send/recv, isend/irecv), plus an
any-source receive and a tagged exchange. Run on 3 ranks; RESULT is what each rank saw."""

import torch
from tutorial_dist import dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1234)
payload = torch.randn(2, 2)  # the same on every rank: the receivers know what to expect
RESULT = {}

# blocking: 0 -> 1
if rank == 0:
    dist.send(payload, dst=1)
elif rank == 1:
    t = torch.zeros(2, 2)
    dist.recv(t, src=0)
    RESULT["blocking"] = t.tolist()

# non-blocking: 1 -> 2 with a tag, request.wait()
if rank == 1:
    req = dist.isend(payload * 2, dst=2, tag=7)
elif rank == 2:
    t = torch.zeros(2, 2)
    req = dist.irecv(t, src=1, tag=7)
if rank in (1, 2):
    req.wait()
    if rank == 2:
        RESULT["non_blocking"] = t.tolist()

# any source: ranks 1 and 2 each send their rank to 0, which learns the sender from recv()
if rank == 0:
    got = {}
    for _ in range(2):
        t = torch.zeros(1)
        sender = dist.recv(t)
        got[sender] = t.item()
    RESULT["any_source"] = sorted(got.items())
else:
    dist.send(torch.tensor([float(rank * 10)]), dst=0)

dist.barrier()
dist.destroy_process_group()
