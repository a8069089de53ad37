"""Our DDP's communication hooks and join() against torch DDP's, bit for bit (float32).

Every test trains the same model on the same data twice per rank: torch's DDP with torch's hook
(or torch's join) and our DDP with ours, and compares the parameters with ``torch.equal``.

Why P=3 differs from P=2, and the warm-up:

* At P=2 an all-reduced element is a + b, which does not depend on who adds first: every one of
  our algorithms gives Gloo's bits, from the first step.
* At P=3, Gloo's ring adds an element's three terms in an order that depends on the element's
  position in the flat buffer, so the bits depend on the bucket layout. torch's DDP packs its
  *first* backward into one bucket in parameter registration order (it does not know the
  backward order yet) and then rebuilds its buckets in gradient-ready order, which is our
  layout (reverse registration order). So at P=3 both models first run one synchronized
  backward without an optimizer step (``warm_up``); from then on the layouts are equal and our
  ``algorithm="native"`` (Gloo's all-reduce on the same buffer) gives torch's bits. Our ring,
  tree and star add in their own orders: at P=3 they are compared with a tolerance (a few
  float32 ulps through 5 steps; the half-precision hooks round their sums to 8 or 11 bits).
* torch refuses to *register* a hook named ``bf16_compress_hook`` without NCCL (a name check;
  Gloo sums bfloat16 fine), so torch's bf16 hook is registered under another name here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from distrain.errors import CommError, ConfigError
from distrain.parallel.data_parallel import DistributedDataParallel, GradBucket, comm_hooks
from distrain.parallel.data_parallel.powersgd import PowerSGDState, powersgd_hook

from conftest import expect_error, run_ranks

ALGS = ["native", "ring", "tree", "star"]
STEPS = 5


def _torch_bf16_hook(state, bucket):
    """torch's bf16_compress_hook under another name (see the module docstring)."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _powersgd(rank: int, start: int = 2, **kw):
    """(torch's PowerSGD (state, hook), ours), fresh states, the same settings."""
    return (lambda: (torch_powersgd.PowerSGDState(None, rank, start, **kw), torch_powersgd.powerSGD_hook),
            lambda: (PowerSGDState(None, rank, start, **kw), powersgd_hook))


# name: (torch's (state, hook), ours (state, hook), atol at P=3 for ring/tree/star)
HOOKS = {
    "allreduce": (lambda: (None, default_hooks.allreduce_hook), lambda: (None, comm_hooks.allreduce_hook), 1e-6),
    "fp16": (lambda: (None, default_hooks.fp16_compress_hook), lambda: (None, comm_hooks.fp16_compress_hook), 2e-4),
    "bf16": (lambda: (None, _torch_bf16_hook), lambda: (None, comm_hooks.bf16_compress_hook), 2e-3),
    # rank 1: every weight compressed; rank 2: the 4 x 32 weight is not (too small to gain)
    "powersgd-r1": (*_powersgd(1), 1e-6),
    "powersgd-r2": (*_powersgd(2), 1e-6),
    # rank 4: QR instead of Gram-Schmidt; the two 32 x 16 weights compressed as one batch
    "powersgd-r4-batched": (*_powersgd(4, batch_tensors_with_same_shape=True), 1e-6),
    # no memory: a fresh random Q every step, no error feedback (then iteration 1 may compress)
    "powersgd-r1-cold": (*_powersgd(1, start=1, warm_start=False, use_error_feedback=False), 1e-6),
}


def _mlp(batchnorm: bool = False) -> nn.Module:
    """Weights of 32 x 16 (twice: the same shape), 16 x 32 and 4 x 32, and their biases.

    ``batchnorm``: with running statistics (buffers) but no affine weights: an affine
    BatchNorm's weight gradient is ready before its bias, so torch's rebuilt bucket holds them
    in that order while ours holds them in reverse registration order (bias, weight): at P=3
    that alone changes Gloo's summation order for those elements."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(32, affine=False)] if batchnorm else []
    return nn.Sequential(nn.Linear(16, 32), *norm, nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 32),
                         nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)  # every rank its own data
    return torch.randn(6, 16, generator=g) + 0.1 * rank, torch.randint(0, 4, (6,), generator=g)


def _train(model: nn.Module, rank: int, steps: int, warm_up: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if warm_up:  # a synchronized backward, no step: torch's buckets take their final layout
        F.cross_entropy(model(_batch(-1, rank)[0]), _batch(-1, rank)[1]).backward()
        opt.zero_grad()
    for s in range(steps):
        x, y = _batch(s, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [t.detach().clone() for t in model.module.state_dict().values()]


def _compare(what: str, got: list[torch.Tensor], ref: list[torch.Tensor], exact: bool, atol: float) -> list[str]:
    bad = []
    for i, (a, b) in enumerate(zip(got, ref)):
        same = torch.equal(a, b) if exact else torch.allclose(a.double(), b.double(), rtol=0, atol=atol)
        if not same:
            diff = (a.double() - b.double()).abs().max().item()
            bad.append(f"{what}: tensor {i} {'not bitwise equal' if exact else 'too far'} (max diff {diff:.3e})")
    return bad


# ---------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------

def _hook_vs_torch(rank: int, name: str) -> list[str]:
    P = dist.get_world_size()
    warm_up = P > 2
    theirs, ours, atol = HOOKS[name]
    ref_model = nn.parallel.DistributedDataParallel(_mlp())
    ref_model.register_comm_hook(*theirs())
    ref = _train(ref_model, rank, STEPS, warm_up)
    bad = []
    for alg in ALGS:
        state, hook = ours()
        model = DistributedDataParallel(_mlp(), algorithm=alg)
        model.register_comm_hook(state, hook)
        bad += _compare(f"P={P} our {name} hook, {alg}", _train(model, rank, STEPS, warm_up), ref,
                        exact=P == 2 or alg == "native", atol=atol)
        if isinstance(state, PowerSGDState):  # it did compress, and counted every backward pass
            rate, before, after = state.compression_stats()
            if not (rate > 1 and after < before and state.iter == STEPS + warm_up):
                bad.append(f"{alg}: PowerSGD stats {state.compression_stats()}, iter {state.iter}")
    # torch's own hook on our DDP: it calls torch.distributed (Gloo) on our GradBucket
    model = DistributedDataParallel(_mlp(), algorithm="ring")
    model.register_comm_hook(*theirs())
    bad += _compare(f"P={P} torch's {name} hook on our DDP", _train(model, rank, STEPS, warm_up), ref,
                    exact=True, atol=0)
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P", [2, pytest.param(3, marks=pytest.mark.slow)])  # (fast tier: P = 2)
@pytest.mark.parametrize("name", list(HOOKS))
def test_hook_equals_torch_hook(name, P):
    run_ranks(_hook_vs_torch, P, name, timeout=80)


def _powersgd_differs_from_allreduce(rank: int) -> list[str]:
    """The PowerSGD runs above are not plain averages in disguise."""
    runs = []
    for state, hook in ((None, comm_hooks.allreduce_hook), (PowerSGDState(None, 1, 2), powersgd_hook)):
        model = DistributedDataParallel(_mlp(), algorithm="ring")
        model.register_comm_hook(state, hook)
        runs.append(_train(model, rank, STEPS, False))
    return [] if not torch.equal(runs[0][0], runs[1][0]) else ["PowerSGD gave the plain average's weights"]


@pytest.mark.timeout(60)
def test_powersgd_is_not_the_plain_average():
    run_ranks(_powersgd_differs_from_allreduce, 2, timeout=50)


# ---------------------------------------------------------------------------------------
# join(): uneven inputs
# ---------------------------------------------------------------------------------------

def _train_uneven(model: nn.Module, rank: int, warm_up: bool, **join_kw) -> list[torch.Tensor]:
    """Rank r has 3 + r batches; the model's join() carries the others through."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if warm_up:
        F.cross_entropy(model(_batch(-1, rank)[0]), _batch(-1, rank)[1]).backward()
        opt.zero_grad()
    with model.join(**join_kw):
        for s in range(3 + rank):
            x, y = _batch(s, rank)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return [t.detach().clone() for t in model.module.state_dict().values()]


def _join_vs_torch(rank: int) -> list[str]:
    P = dist.get_world_size()
    warm_up = P > 2
    bad, results = [], {}
    # BatchNorm: running statistics are broadcast before each forward from the highest rank
    # still training (rank 0 runs out first), and with the parameters at the end
    for divide in (True, False):
        ref = _train_uneven(nn.parallel.DistributedDataParallel(_mlp(batchnorm=True)), rank, warm_up,
                            divide_by_initial_world_size=divide)
        results[divide] = ref
        for alg in ALGS:
            got = _train_uneven(DistributedDataParallel(_mlp(batchnorm=True), algorithm=alg), rank, warm_up,
                                divide_by_initial_world_size=divide)
            bad += _compare(f"P={P} join(divide_by_initial_world_size={divide}), {alg}", got, ref,
                            exact=P == 2 or alg == "native", atol=1e-6)
    if torch.equal(results[True][0], results[False][0]):
        bad.append("divide_by_initial_world_size changes nothing")
    # with a hook: the joined ranks run it on zero buckets (PowerSGD's three all-reduces each)
    theirs, ours, _ = HOOKS["powersgd-r1"]
    ref_model = nn.parallel.DistributedDataParallel(_mlp())
    ref_model.register_comm_hook(*theirs())
    ref = _train_uneven(ref_model, rank, warm_up)
    for alg in ("native", "tree"):
        model = DistributedDataParallel(_mlp(), algorithm=alg)
        model.register_comm_hook(*ours())
        bad += _compare(f"P={P} join with PowerSGD, {alg}", _train_uneven(model, rank, warm_up), ref,
                        exact=P == 2 or alg == "native", atol=1e-6)
    # every rank ends with the model of the rank that trained longest
    mine = torch.cat([t.reshape(-1).float() for t in results[True]])
    rows = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(rows, mine)
    if not all(torch.equal(r, rows[0]) for r in rows):
        bad.append("the ranks' models differ after join()")
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P", [2, pytest.param(3, marks=pytest.mark.slow)])  # (fast tier: P = 2)
def test_join_uneven_inputs_equals_torch_join(P):
    run_ranks(_join_vs_torch, P, timeout=80)


def _shared_memory_vs_torch(rank: int) -> list[str]:
    """On the shm transport "native" all-reduces the gradients themselves (no bucket copy), so
    a joined rank answers with all_reduce_list on zeros; hooks use the shm collectives."""
    bad = []
    ref = _train_uneven(nn.parallel.DistributedDataParallel(_mlp(batchnorm=True)), rank, False)
    for alg in ("native", "ring"):
        bad += _compare(f"shm join, {alg}", _train_uneven(DistributedDataParallel(_mlp(batchnorm=True), algorithm=alg),
                                                          rank, False), ref, exact=True, atol=0)
    theirs, ours, _ = HOOKS["powersgd-r2"]
    ref_model = nn.parallel.DistributedDataParallel(_mlp())
    ref_model.register_comm_hook(*theirs())
    ref = _train_uneven(ref_model, rank, False)
    model = DistributedDataParallel(_mlp(), algorithm="native")
    model.register_comm_hook(*ours())
    return bad + _compare("shm join with PowerSGD, native", _train_uneven(model, rank, False), ref, exact=True, atol=0)


@pytest.mark.timeout(60)
def test_join_and_hooks_on_shared_memory_equal_torch():
    run_ranks(_shared_memory_vs_torch, 2, timeout=50, env={"DISTRAIN_TRANSPORT": "shm"})


def _join_throws(rank: int) -> list[str]:
    model = DistributedDataParallel(_mlp(), algorithm="tree")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with model.join(throw_on_early_termination=True):
            for s in range(2 + 2 * rank):
                x, y = _batch(s, rank)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    except CommError as e:
        return [] if "throw_on_early_termination=True" in str(e) and "ran out of inputs" in str(e) else [str(e)]
    return ["no error although rank 0 ran out of inputs"]


@pytest.mark.timeout(60)
def test_join_throw_on_early_termination_stops_every_rank():
    run_ranks(_join_throws, 2, timeout=50)


# ---------------------------------------------------------------------------------------
# Errors and the bucket
# ---------------------------------------------------------------------------------------

def _registration_errors(rank: int) -> list[str]:
    x, y = _batch(0, rank)
    twice = DistributedDataParallel(_mlp())
    twice.register_comm_hook(None, comm_hooks.allreduce_hook)
    late = DistributedDataParallel(_mlp())
    F.cross_entropy(late(x), y).backward()
    compressed = DistributedDataParallel(_mlp(), compression="bf16")
    bad_future = DistributedDataParallel(_mlp())
    bad_future.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    where = "DistributedDataParallel.register_comm_hook: "
    errs = [
        expect_error(lambda: twice.register_comm_hook(None, comm_hooks.fp16_compress_hook), ConfigError,
                     where + "a communication hook (allreduce_hook) is already registered and a model takes only "
                     "one; register a single hook, once, right after wrapping the model"),
        expect_error(lambda: late.register_comm_hook(None, comm_hooks.allreduce_hook), ConfigError,
                     where + "called after a backward pass; register the hook before the first backward (right "
                     "after wrapping the model), as torch DDP requires"),
        expect_error(lambda: compressed.register_comm_hook(None, comm_hooks.allreduce_hook), ConfigError,
                     where + "compression= and a hook both decide", "fp16_compress_hook or bf16_compress_hook"),
        expect_error(lambda: DistributedDataParallel(_mlp()).register_comm_hook(None, lambda bucket: None),
                     ConfigError, where + "hook must be a callable hook(state, bucket) -> torch.futures.Future"),
        expect_error(lambda: F.cross_entropy(bad_future(x), y).backward(), ConfigError,
                     "returned Tensor; a hook returns a torch.futures.Future"),
    ]
    return [e for e in errs if e]


@pytest.mark.timeout(60)
def test_register_comm_hook_errors_name_the_fix():
    run_ranks(_registration_errors, 2, timeout=50)


def test_powersgd_state_needs_two_plain_iterations_with_memory():
    with pytest.raises(ConfigError, match="start_powerSGD_iter must be at least 2 with error feedback or warm start"):
        PowerSGDState(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)


def test_grad_bucket_has_torchs_methods():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    buf = torch.arange(10.0)
    b = GradBucket(1, 2, buf, params, group=None, algorithm="ring")
    assert (b.index(), b.is_last(), b.buffer() is buf) == (1, True, True)
    assert all(a is p for a, p in zip(b.parameters(), params)) and len(b.parameters()) == 2
    g = b.gradients()
    assert [t.shape for t in g] == [(2, 3), (4,)] and g[1].data_ptr() == buf[6:].data_ptr()
    b.set_buffer(buf.half())  # gradients() then views the new buffer, as torch's
    assert b.buffer().dtype == torch.float16 and b.gradients()[0].dtype == torch.float16
    assert not GradBucket(0, 2, buf, params, None, "ring").is_last()
