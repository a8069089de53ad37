"""Parameter servers: layout, sync == single process, exact bytes, async staleness bound, failures."""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch

import distrain
from distrain import comm
from distrain.data import DistributedBatchSampler, load_digits
from distrain.errors import CommError, ConfigError, RankFailedError
from distrain.models import build_model, classification_loss
from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker, expected_ps_bytes

from conftest import one_process_losses

G = 12      # global batch of the sync tests
SEED = 0
OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


# ---------------------------------------------------------------------------- layout (pure)
def test_layout_roles():
    L = PSLayout(5, 2, [(3, 4), (4,)])
    assert (L.num_workers, L.num_servers, L.workers, L.servers) == (3, 2, [0, 1, 2], [3, 4])
    assert [L.role(r) for r in range(5)] == ["worker"] * 3 + ["server"] * 2
    assert (L.server_rank(0), L.server_rank(1), L.server_index(4)) == (3, 4, 1)
    with pytest.raises(ConfigError, match="rank 1 is a worker"):
        L.server_index(1)
    with pytest.raises(ConfigError, match=r"rank 5 is outside \[0, 5\)"):
        L.role(5)


def test_layout_balances_by_bytes_greedily():
    # bytes 40, 400, 120, 280, 4: 400 -> s0; 280 -> s1; 120 -> s1 (280 < 400); 40 -> s0 (tie 400/400: fewer
    # params); 4 -> s1 (400 < 440). Shards keep model order.
    L = PSLayout(3, 2, [(10,), (10, 10), (30,), (7, 10), 1])
    assert L.owner == (0, 0, 1, 1, 1)
    assert (L.params_of(0), L.params_of(1)) == ([0, 1], [2, 3, 4])
    assert (L.shard_bytes(0), L.shard_bytes(1), L.total_bytes) == (440, 404, 844)
    # by bytes, not elements: 10 fp64 elements outweigh 30 fp16 ones
    L = PSLayout(4, 2, [10, 30, 5], element_sizes=[8, 2, 8])
    assert L.owner == (0, 1, 1) and (L.shard_bytes(0), L.shard_bytes(1)) == (80, 100)
    # deterministic ties: equal sizes alternate in index order
    assert PSLayout(3, 2, [4, 4, 4, 4]).owner == (0, 1, 0, 1)
    assert PSLayout(2, 1, [4, 4]).owner == (0, 0)
    # a real model: three balanced servers, every parameter owned once
    model = build_model("mlp-tiny")
    L = PSLayout.from_model(model, 5, 3)
    assert L.total_bytes == 6570 * 4 and sorted(sum((L.params_of(s) for s in range(3)), [])) == list(range(6))
    assert max(L.shard_bytes(s) for s in range(3)) == 64 * 64 * 4  # the largest tensor alone
    assert "server 0 (rank 2)" in L.describe()


def test_layout_errors():
    with pytest.raises(ConfigError, match=re.escape(
            "nproc 2 is too small for 2 servers: need at least 3 processes (S servers + at least 1 worker)")):
        PSLayout(2, 2, [4, 4])
    with pytest.raises(ConfigError, match="nproc 1 is too small for 1 server: need at least 2 processes"):
        PSLayout(1, 1, [4])
    with pytest.raises(ConfigError, match="number of servers must be an int >= 1, got 0"):
        PSLayout(4, 0, [4])
    with pytest.raises(ConfigError, match="3 servers but the model has only 2 parameter tensors"):
        PSLayout(5, 3, [4, 4])
    with pytest.raises(ConfigError, match="no parameters to serve"):
        PSLayout(3, 1, [])
    with pytest.raises(ConfigError, match="has no elements"):
        PSLayout(3, 1, [(0, 3)])
    with pytest.raises(ConfigError, match="element_sizes must be one positive int or one per parameter"):
        PSLayout(3, 1, [4, 4], element_sizes=[4])
    with pytest.raises(ConfigError, match="mode must be 'sync' or 'async'"):
        ParameterServer(build_model("mlp-tiny"), PSLayout(3, 1, [4]), OPTS["sgd"], mode="hogwild")
    with pytest.raises(ConfigError, match="max_staleness applies to mode='async' only"):
        ParameterServer(build_model("mlp-tiny"), PSLayout(3, 1, [4]), OPTS["sgd"], mode="sync", max_staleness=2)
    with pytest.raises(ConfigError, match="max_staleness must be None or an int >= 0"):
        ParameterServer(build_model("mlp-tiny"), PSLayout(3, 1, [4]), OPTS["sgd"], mode="async", max_staleness=-1)
    with pytest.raises(ConfigError, match="no process group"):
        PSWorker(build_model("mlp-tiny"), PSLayout(3, 1, [4]))


def test_expected_bytes_formula():
    L = PSLayout(5, 2, [(10,), (10, 10), (30,), (7, 10), 1])  # shards 440 and 404 bytes, W = 3
    e = expected_ps_bytes(L, steps=2, final_pull=True)
    for w in (0, 1, 2):
        assert e[w] == {"ps_pull_sent": 0, "ps_pull_recv": 3 * 844, "ps_push_sent": 2 * 844, "ps_push_recv": 0,
                        "sent": 2 * 844, "recv": 3 * 844}
    assert e[3]["ps_pull_sent"] == 3 * 3 * 440 and e[3]["ps_push_recv"] == 2 * 3 * 440
    assert e[4]["ps_pull_sent"] == 3 * 3 * 404 and e[4]["ps_push_recv"] == 2 * 3 * 404
    assert sum(e[r]["sent"] for r in e) == sum(e[r]["recv"] for r in e)


# ---------------------------------------------------------------------------- multi-process runs
@functools.lru_cache(maxsize=None)
def _digits():
    """The digits training set in fp64, loaded once here and handed to the ranks (no sklearn import there)."""
    return load_digits(dtype=torch.float64)[0]


def _ps_job(rank: int, train, S: int, mode: str, K, steps: int, global_batch: int, opt_names: tuple,
            fail: str = "") -> list:
    """Train mlp-tiny (fp64) on digits with S servers; one result dict per optimizer."""
    import torch.distributed as dist

    out = []
    for opt in opt_names:
        torch.manual_seed(SEED)
        model = build_model("mlp-tiny").double()
        layout = PSLayout.from_model(model, dist.get_world_size(), S)
        res: dict = {}
        with comm.ledger() as led:
            try:
                if layout.is_server(rank):
                    server = ParameterServer(model, layout, OPTS[opt], mode, K)
                    res["stats"] = server.serve(steps)
                    res["shard"] = server.state_dict()
                else:
                    sampler = DistributedBatchSampler(len(train), global_batch, rank, layout.num_workers, seed=SEED)
                    worker = PSWorker(model, layout, mode)
                    res["losses"] = []
                    for t in range(steps):
                        x, y = train.get_batch(sampler.batch(t))
                        worker.pull()
                        if fail == "raise" and rank == 1 and t == 2:
                            raise RuntimeError("injected worker failure at step 2")
                        if fail == "leave" and rank == 1 and t == 2:
                            return [{"left": True}]
                        loss = classification_loss(model(x), y)
                        loss.backward()
                        worker.push()
                        res["losses"].append(loss.item())
                    worker.pull()  # final pull: the weights after every update
                    res["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            except CommError as e:
                if fail != "leave":
                    raise
                return [{"error": str(e)}]
        res["ledger"] = {k: (c.bytes_sent, c.bytes_recv, c.msgs_sent, c.msgs_recv)
                         for k in ("ps_pull", "ps_push", "ps_ctrl") for c in [led.get(k, "p2p")]}
        out.append(res)
    return out


def _reference(opt: str, batches: list[torch.Tensor]) -> tuple[list[float], dict]:
    """Single process: one optimizer step per index batch; returns losses and final weights."""
    train = _digits()
    torch.manual_seed(SEED)
    model = build_model("mlp-tiny").double()
    losses = one_process_losses(model, OPTS[opt](list(model.parameters())), classification_loss,
                                map(train.get_batch, batches))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


SYNC_STEPS = 4


@functools.lru_cache(maxsize=None)
def _sync_run(S: int, W: int) -> tuple:
    args = (_digits(), S, "sync", None, SYNC_STEPS, G, ("sgd", "adam"))
    return tuple(distrain.spawn(_ps_job, S + W, args=args, timeout=90))


def _server_weights(results: list, W: int, k: int) -> dict:
    return {n: t for r in results[W:] for n, t in r[k]["shard"].items()}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("S,W", [(1, 2), (2, 2), (1, 3), (2, 3)])
def test_sync_ps_equals_single_process(S, W):
    results = _sync_run(S, W)
    sampler = DistributedBatchSampler(len(_digits()), G, 0, 1, seed=SEED)
    for k, opt in enumerate(("sgd", "adam")):
        ref_losses, ref = _reference(opt, [sampler.batch(t) for t in range(SYNC_STEPS)])
        # the global-batch loss is the mean of the workers' local losses (equal local batches)
        losses = [sum(results[w][k]["losses"][t] for w in range(W)) / W for t in range(SYNC_STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12)
        shards = _server_weights(results, W, k)
        assert sorted(shards) == sorted(ref)
        for n in ref:
            torch.testing.assert_close(shards[n], ref[n], rtol=1e-10, atol=1e-12, msg=f"{opt} S={S} W={W} {n}")
            for w in range(W):  # every worker's final pull has the same weights
                torch.testing.assert_close(results[w][k]["final"][n], ref[n], rtol=1e-10, atol=1e-12)
        for r in results[W:]:
            st = r[k]["stats"]
            assert (st["updates"], st["pushes"], st["staleness_max"]) == (SYNC_STEPS, W * SYNC_STEPS, 0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("S,W", [(1, 2), (2, 3)])
def test_sync_ledger_equals_expected_bytes(S, W):
    results = _sync_run(S, W)
    layout = PSLayout.from_model(build_model("mlp-tiny").double(), S + W, S)
    exp = expected_ps_bytes(layout, steps=SYNC_STEPS, final_pull=True)
    per_step = expected_ps_bytes(layout)
    N = layout.total_bytes
    assert N == 6570 * 8
    for r, res in enumerate(results):
        for k in range(2):
            pull, push, ctrl = (res[k]["ledger"][x] for x in ("ps_pull", "ps_push", "ps_ctrl"))
            assert (pull[0], pull[1], push[0], push[1]) == (
                exp[r]["ps_pull_sent"], exp[r]["ps_pull_recv"], exp[r]["ps_push_sent"], exp[r]["ps_push_recv"])
            if layout.is_server(r):  # W messages of N_s per step each way
                Ns = layout.shard_bytes(layout.server_index(r))
                assert per_step[r]["sent"] == W * Ns and per_step[r]["recv"] == W * Ns
                assert (pull[2], push[3]) == (W * (SYNC_STEPS + 1), W * SYNC_STEPS)
                assert ctrl[:3] == (W * 7 * 8, 0, W)  # the hello only
            else:  # N each way per step, one flat message per server
                assert per_step[r]["sent"] == N and per_step[r]["recv"] == N
                assert (pull[3], push[2]) == (S * (SYNC_STEPS + 1), S * SYNC_STEPS)
                assert ctrl[1] == S * 7 * 8 and ctrl[0] == 0


ASYNC_STEPS = 30


@pytest.mark.timeout(150)
@pytest.mark.parametrize("S,K", [(1, None), (1, 0), (2, 2)])
def test_async_ps_trains_within_the_staleness_bound(S, K):
    W = 3
    t0 = time.monotonic()
    results = distrain.spawn(_ps_job, S + W, args=(_digits(), S, "async", K, ASYNC_STEPS, 48, ("adam",)), timeout=90)
    elapsed = time.monotonic() - t0
    layout = PSLayout.from_model(build_model("mlp-tiny").double(), S + W, S)
    exp = expected_ps_bytes(layout, steps=ASYNC_STEPS, final_pull=True)
    for r in range(S + W):
        pull, push = results[r][0]["ledger"]["ps_pull"], results[r][0]["ledger"]["ps_push"]
        assert (pull[0], pull[1], push[0], push[1]) == (
            exp[r]["ps_pull_sent"], exp[r]["ps_pull_recv"], exp[r]["ps_push_sent"], exp[r]["ps_push_recv"])
    for st in (results[r][0]["stats"] for r in layout.servers):
        assert st["updates"] == st["pushes"] == W * ASYNC_STEPS == sum(st["staleness_hist"].values())
        if K is not None:
            assert st["staleness_max"] <= K, st
        if K == 0:
            assert st["staleness_hist"] == {0: W * ASYNC_STEPS}
    # the loss falls: the final weights (identical on every worker) against the initial ones, on 600 samples
    train = _digits()
    x, y = train.get_batch(torch.arange(600))
    torch.manual_seed(SEED)
    model = build_model("mlp-tiny").double()
    with torch.no_grad():
        before = classification_loss(model(x), y).item()
        for w in range(1, W):
            for n, t in results[w][0]["final"].items():
                torch.testing.assert_close(t, results[0][0]["final"][n], rtol=0, atol=0)
        model.load_state_dict(results[0][0]["final"])
        after = classification_loss(model(x), y).item()
    assert after < 0.5 * before, (before, after)
    if K == 0:
        # K = 0 serializes the workers: exactly sequential Adam over the local batches in apply order
        order = results[W][0]["stats"]["apply_order"]
        samplers = [DistributedBatchSampler(len(train), 48, w, W, seed=SEED) for w in range(W)]
        _, ref = _reference("adam", [samplers[w].batch(t) for w, t in order])
        for n, t in ref.items():
            torch.testing.assert_close(results[0][0]["final"][n], t, rtol=1e-10, atol=1e-12)
    print(f"async S={S} K={K}: loss {before:.3f} -> {after:.3f}, staleness "
          f"{[results[r][0]['stats']['staleness_hist'] for r in layout.servers]}, {elapsed:.1f}s")


# ---------------------------------------------------------------------------- failures
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failing_worker_is_reported_not_a_hang(mode):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as ei:
        distrain.spawn(_ps_job, 3, args=(_digits(), 1, mode, None, 6, G, ("sgd",), "raise"), timeout=60)
    assert ei.value.rank == 1 and "injected worker failure at step 2" in str(ei.value)
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_survivors_name_the_peer_that_left(mode):
    # worker 1 leaves after its pull of step 2: the server and worker 0 raise readable CommErrors
    res = distrain.spawn(_ps_job, 3, args=(_digits(), 1, mode, None, 6, G, ("sgd",), "leave"), timeout=60)
    assert res[1] == [{"left": True}]
    assert res[2][0]["error"].startswith("parameter server rank 2: worker rank 1 disconnected during push of step 2: ")
    assert re.match(r"worker rank 0: parameter server rank 2 disconnected during (pull|push) of step \d",
                    res[0][0]["error"]), res[0][0]["error"]


def _mismatched_modes(rank: int):
    torch.manual_seed(SEED)
    model = build_model("mlp-tiny")
    layout = PSLayout.from_model(model, 3, 1)
    if layout.is_server(rank):
        ParameterServer(model, layout, OPTS["sgd"], "sync").serve(2)
    else:
        PSWorker(model, layout, "async").pull()


@pytest.mark.timeout(90)
def test_mode_mismatch_is_a_clear_error():
    with pytest.raises(RankFailedError) as ei:
        distrain.spawn(_mismatched_modes, 3, timeout=60)
    assert ei.value.rank in (0, 1)
    assert (f"worker rank {ei.value.rank}: parameter server rank 2 disagrees on the set-up: it serves mode 'sync', "
            f"1 servers, 2 workers, shard 0 of 6570 elements; this worker expects mode 'async'") in str(ei.value)
