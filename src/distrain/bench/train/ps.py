"""``distrain bench ps``: time synchronous parameter-server rounds, beside the cost model's ``predict_ps``.

One round is what a ps-sync training step spends on the network and the servers: every
worker pulls the weights (one message from each of the S servers), pushes a gradient of
the same size (one message to each server), and every server adds the W gradients and
takes an SGD step. It runs the real code (:class:`~distrain.parallel.parameter_server.
ParameterServer` and :class:`~distrain.parallel.parameter_server.PSWorker`, mode "sync")
on a model of S·k equal float32 tensors (k = 4), so the greedy byte balance gives every
server exactly N/S bytes.

Timing: a worker's round i is the time from the start of its pull i to the start of its
pull i+1 (the last round ends at the final pull). A worker's push returns once its bytes
are written to the socket, not when the server has them, so the interval between pulls is
the honest round time: it contains pull, push, and the server's add and step, because a
server answers pull i+1 only after its step i. Per round the slowest worker counts;
reported is the median over ``--iters`` rounds after ``--warmup`` (the benchmarks'
convention). With ``--predict`` the links come from a calibration (``distrain bench link
--json``, or a short ping-pong when the flag has no value) and every record gets
``predicted_us`` from :func:`distrain.costmodel.predict_ps` and ``predicted_error_pct``.

Records use ``bench comm``'s keys (``op`` = "ps", ``algorithm`` = "ps S=<S>", ``P``,
``size_bytes``, ``time_us``), so ``python -m distrain.bench.comm.predict`` tabulates them.
Run it across nodes with ``distrain cluster run -- distrain bench ps ...`` (P = world
size, S servers on the last S ranks); without a launcher it spawns ``--nproc`` local ranks.
"""

from __future__ import annotations

import os
import time

import torch

from distrain import comm
from distrain.bench import common
from distrain.errors import ConfigError

TENSORS_PER_SERVER = 4


def _model(nbytes: int, servers: int) -> torch.nn.Module:
    """S·k equal float32 parameters summing to ``nbytes`` (the greedy layout balances them exactly)."""
    k = servers * TENSORS_PER_SERVER
    n = nbytes // 4
    if n % k:
        raise ConfigError(f"--sizes: {nbytes} bytes is not {k} equal float32 tensors; give a multiple of {4 * k} bytes")
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n // k)) for _ in range(k)])
    return m


def _round_times(model: torch.nn.Module, servers: int, steps: int) -> list[float]:
    """This rank's part of ``steps`` sync rounds and the final pull; a worker returns its round times."""
    import torch.distributed as dist

    from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker

    layout = PSLayout.from_model(model, dist.get_world_size(), servers)
    if layout.is_server(dist.get_rank()):
        ParameterServer(model, layout, lambda ps: torch.optim.SGD(ps, lr=1e-3), "sync").serve(steps)
        return []
    worker = PSWorker(model, layout, "sync")
    grads = [torch.ones_like(p) for p in model.parameters()]
    starts = []
    for _ in range(steps):
        starts.append(time.perf_counter())
        worker.pull()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        worker.push()
    starts.append(time.perf_counter())
    worker.pull()  # the final pull: round steps-1 ends when the server answers it
    return [b - a for a, b in zip(starts, starts[1:])]


def _worker(rank: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from distrain.bench.comm import predict as comm_predict
    from distrain.costmodel import predict_ps

    P = dist.get_world_size()
    fabric = comm_predict.setup(cfg["predict"], rank) if cfg.get("predict") else None
    records = []
    for S in cfg["servers"]:
        for size in cfg["sizes"]:
            dist.barrier()
            mine = _round_times(_model(size, S), S, cfg["warmup"] + cfg["iters"])
            every = comm.all_gather_data(mine, algorithm=None)
            per_round = common.slowest_rank_times([t[cfg["warmup"]:] for t in every if t])
            rec = {"op": "ps", "algorithm": f"ps S={S}", "P": P, "S": S, "W": P - S, "size_bytes": size,
                   "time_us": common.median(per_round) * 1e6, "times_us": [t * 1e6 for t in per_round]}
            if fabric is not None:
                pred = predict_ps(size, S, fabric).seconds * 1e6
                rec.update(predicted_us=pred, predicted_error_pct=100.0 * (pred - rec["time_us"]) / rec["time_us"],
                           placement=list(fabric.placement))
            if rank == 0:
                common.progress(f"[ps] P={P} S={S} {common.format_size(size)}: {rec['time_us'] / 1e3:.1f} ms"
                                + (f", predicted {rec['predicted_us'] / 1e3:.1f} ms" if fabric is not None else ""))
            records.append(rec)
    return records


def _launched(cfg: dict) -> list[dict]:
    from distrain import runtime

    if runtime.launched_rank(os.environ) is not None:
        runtime.init(timeout=900)
        import torch.distributed as dist

        try:
            recs = _worker(dist.get_rank(), cfg)
            return recs if dist.get_rank() == 0 else []
        finally:
            runtime.shutdown()
    import distrain

    return distrain.spawn(_worker, cfg["nproc"], args=(cfg,), timeout=900)[0]


def run(sizes: list[int], servers: list[int], warmup: int, iters: int, nproc: int, predict: str | None = None,
        json_path: str | None = None) -> int:
    """Time a round for every server count and model size (``nproc`` local ranks when not launched);
    ``predict``: a calibration file, or "auto" to calibrate now, for the cost model's prediction
    beside each; print the table and write ``json_path``."""
    cfg = {"sizes": list(sizes), "servers": list(servers), "warmup": warmup, "iters": iters, "nproc": nproc,
           "predict": predict}
    if iters < 1 or warmup < 0:
        raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    from distrain import runtime

    launched = runtime.launched_rank(os.environ)
    world = launched[1] if launched is not None else nproc
    if max(cfg["servers"]) >= world:
        raise ConfigError(f"--servers: {max(cfg['servers'])} servers need at least {max(cfg['servers']) + 1} "
                          f"processes (S servers + at least 1 worker); this run has {world}")
    if predict not in (None, "auto") and not os.path.isfile(predict):
        raise ConfigError(f"--predict: no calibration file {predict!r}; write one with "
                          f"`distrain bench link --json {predict}` or give --predict alone to calibrate now")
    for S in cfg["servers"]:
        for size in cfg["sizes"]:
            _model(size, S)  # a size that cannot be balanced fails here, before any process starts
    records = _launched(cfg)
    if not records:  # not rank 0
        return 0
    head = ["P", "S", "size", "measured ms", "predicted ms", "error"]
    rows = [[str(r["P"]), str(r["S"]), common.format_size(r["size_bytes"]), f"{r['time_us'] / 1e3:.1f}",
             f"{r['predicted_us'] / 1e3:.1f}" if "predicted_us" in r else "-",
             f"{r['predicted_error_pct']:+.1f}%" if "predicted_us" in r else "-"] for r in records]
    print(common.format_table([("parameter server round (pull + push + update)", head)], rows))
    if json_path:
        common.write_json(json_path, common.metadata(benchmark="ps", sizes=cfg["sizes"], servers=cfg["servers"],
                                                     warmup=cfg["warmup"], iters=cfg["iters"],
                                                     loadavg_after=os.getloadavg()), records)
        common.progress(f"wrote {json_path}")
    return 0
