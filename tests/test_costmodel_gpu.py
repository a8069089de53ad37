"""The planner for clusters of devices: shapes, kernels, memory, layouts, validation, speed, errors."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import pytest

from distrain.costmodel import collectives, devices, kernels, layouts, memory, shapes, step
from distrain.costmodel.links import INTRA, LINKS, Fabric, block_placement, calibrated_fabric
from distrain.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "docs" / "cost_model_data"


def _cluster(dev="h100", nodes=1, per_node=8, link="ib-400g"):
    d = devices.device(dev)
    return step.Cluster(d, nodes, per_node, LINKS[link], INTRA[d.intra])


@pytest.mark.timeout(120)
def test_shapes_count_every_tensor_of_the_built_presets():
    import torch

    from distrain.models import build_model
    from distrain.models.registry import MODEL_PRESETS

    for name, (kind, _) in MODEL_PRESETS.items():
        if kind not in ("gpt", "llama"):
            continue
        with torch.device("meta"):
            m = build_model(name)
        s = shapes.preset_shape(name)
        assert s.params() == sum(p.numel() for p in m.parameters()), name
        assert s.tensor_sizes() == [p.numel() for p in m.parameters() if p.requires_grad], name


def test_published_shapes_have_the_benchmark_tables_parameter_counts():
    with open(DATA / "mosaicml_benchmarks.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 209
    for r in rows:  # every row's NumParams, for every model and sequence length (learned positions)
        assert shapes.with_positions(shapes.preset_shape(r["model"]), int(r["seq"])).params() == int(r["num_params"])


def test_model_flops_are_megatrons_count():
    L, h, a, V, s = 3, 64, 4, 100, 32
    gpt = shapes.Shape("g", L, h, a, a, 4 * h, V, gated=False, bias=True, positions=s)
    assert gpt.model_flops_per_token(s) == 72 * L * h * h + 12 * L * h * s + 6 * h * V  # Narayanan et al., eq. 3
    g, f = 2, 96  # grouped-query attention and SwiGLU: megatron/training/training.py's formula per token
    llama = shapes.Shape("l", L, h, a, g, f, V)
    want = 12 * L * h * h * ((1 + g / a + s / h) + (f / h) * 1.5) + 6 * h * V
    assert llama.model_flops_per_token(s) == pytest.approx(want, rel=1e-12)


def test_matmul_time_quantizes_tiles_and_waves_and_is_bandwidth_bound_when_thin():
    dev = devices.device("h100")
    M, N, K = 33 * kernels.TILE_M, 8 * kernels.TILE_N, 8192  # 264 full tiles: two full waves of 132 SMs
    assert kernels.gemm_seconds(dev, M, N, K) == pytest.approx(2 * M * N * K / (dev.bf16_flops * dev.gemm_eff))
    # a tile that is one row too tall costs a whole second row of tiles: 257 rows take as long as 512
    assert kernels.gemm_seconds(dev, 257, 128 * 132, 8192) == pytest.approx(
        kernels.gemm_seconds(dev, 512, 128 * 132, 8192))
    # one token: reading the 4096 x 4096 weight dominates
    t = kernels.gemm_seconds(dev, 1, 4096, 4096)
    assert t == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / (dev.mem_bw * dev.mem_eff))


def test_recomputation_adds_the_forward_it_reruns():
    bt = kernels.block_time(shapes.preset_shape("llama-3-8b"), devices.device("h100"), 1, 4096)
    assert bt.with_recompute("none") == (bt.forward, bt.backward)
    assert bt.with_recompute("full")[1] == pytest.approx(bt.backward + bt.forward)
    assert bt.with_recompute("selective")[1] == pytest.approx(bt.backward + bt.fwd_attn)
    g, a, e = bt.kinds("full")
    assert g + a + e == pytest.approx(2 * bt.forward + bt.backward)
    assert bt.bwd_attn == pytest.approx(2.5 * bt.fwd_attn)  # FlashAttention-2's backward: 5 matmuls to 2


def test_memory_shards_states_by_zero_stage_and_activations_by_tp_and_recompute():
    s = shapes.preset_shape("llama-3-8b")
    n = s.params()
    kw = dict(tp=1, pp=1, cp=1, dp=8, ep=1, micro_batch=1, seq=4096, microbatches=1, recompute="none")
    states = {z: memory.memory(s, zero=z, **kw).states for z in range(4)}
    assert states[0] == pytest.approx(18 * n)
    assert states[1] == pytest.approx((2 + 4 + 12 / 8) * n)
    assert states[2] == pytest.approx((2 + (4 + 12) / 8) * n)
    assert states[3] == pytest.approx(18 / 8 * n)
    act = memory.block_activation_bytes
    assert act(s, 4096, 1, True, "full") == 2 * 4096 * s.hidden  # only the block input
    assert act(s, 4096, 4, True, "none") == pytest.approx(act(s, 4096, 1, True, "none") / 4)  # tp + sp: all cut
    assert act(s, 4096, 4, False, "none") > act(s, 4096, 4, True, "none")  # without sp the norms' 4h are whole


def test_step_adds_exposed_communication_the_bubble_and_the_optimizer():
    s = shapes.preset_shape("llama-3-8b")
    cl = _cluster(nodes=2, per_node=1)
    lay = step.Layout(dp=2, zero=0, micro_batch=1, dp_overlap=False)
    p = step.predict(s, cl, lay, 4, 2048)
    n = s.params()
    assert p.parts["dp_comm"] == pytest.approx(collectives.nccl_ring(2, 1, 4.0 * n, cl.intra, cl.inter))
    # not overlapped: the whole gradient all-reduce comes after the 2 micro-batches' compute
    assert p.parts["dp_exposed"] == p.parts["dp_comm"]
    assert p.step_s == pytest.approx(p.parts["gemm"] + p.parts["attn"] + p.parts["elem"] + p.parts["dp_comm"]
                                     + p.parts["optimizer"], rel=1e-9)
    # a pipeline of 4 stages over 8 micro-batches waits (pp - 1) / v stage times
    pl = step.predict(s, _cluster(nodes=4, per_node=1), step.Layout(dp=1, pp=4, micro_batch=1), 8, 2048)
    per_stage = (pl.parts["gemm"] + pl.parts["attn"] + pl.parts["elem"]) / (8 + 3)
    assert pl.parts["bubble"] == pytest.approx(3 * per_stage, rel=1e-6)
    pv = step.predict(s, _cluster(nodes=4, per_node=1), step.Layout(dp=1, pp=4, vpp=2, micro_batch=1), 8, 2048)
    assert pv.parts["bubble"] == pytest.approx(pl.parts["bubble"] / 2, rel=1e-6)
    assert pv.step_s < pl.step_s


def test_ranked_layouts_fit_and_the_best_is_explained():
    case = step.Case(shapes.preset_shape("llama-3-8b"), _cluster("a100-40g", nodes=2), step.Layout(), 16, 4096)
    fits, too_big = layouts.rank(case, {})
    assert fits and too_big
    assert all(p.memory.total <= 40e9 for p in fits) and all(p.memory.total > 40e9 for p in too_big)
    steps = [p.step_s for p in fits]  # fastest first (equal to 6 digits: the simpler layout first)
    assert all(a <= b * (1 + 1e-5) for a, b in zip(steps, steps[1:]))
    for p in fits[:20]:
        step.check(case.shape, case.cluster, p.layout, 16, 4096)
        assert p.layout.devices == 16
    line = layouts.explain(fits, 40e9)
    assert line.startswith(f"best: {fits[0].layout.name()}: ") and "\n" not in line


@pytest.mark.parametrize("argv,message", [
    ("--device tpu", "--device 'tpu': unknown device; choose from h100, h200"),
    ("--device a100-40g --nodes 1 --model llama-3-70b --seq-len 4096 --dp 8 --tp 1 --pp 1 --cp 1 --zero 0 "
     "--micro-batch 1 --recompute none", "no layout fits: the smallest, dp8 x tp1 x pp1 x cp1 z0 mb1, needs"),
    ("--device h100 --nodes 4 --model llama-3-8b --seq-len 4096 --dp 8 --tp 2 --pp 1 --cp 1",
     "= 16 devices, but --nodes 4 x --gpus-per-node 8 = 32; make them equal"),
    ("--device h100 --nodes 2 --procs-per-node 4 --gpus-per-node 8", "--procs-per-node 4 and --gpus-per-node 8 "
                                                                     "disagree"),
    ("--device h100 --nodes 1 --model llama-3-8b --seq-len 4096 --tp 3", "--tp 3 x --pp 1 x --cp 1 = 3 does not "
                                                                        "divide the cluster's 8 devices"),
    ("--device h100 --model mpt-7b", "--seq-len: mpt-7b has no preset sequence length"),
    ("--device h100 --layers 4 --hidden 512", "--layers: a model shape also needs --heads, --vocab"),
])
def test_cluster_plans_refuse_bad_input_in_one_line(capsys, argv, message):
    from distrain.cli import main

    assert main(["plan"] + argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cluster_plan_command_prints_the_ranking_and_why(capsys):
    from distrain.cli import main

    assert main("plan --model llama-3-8b --device h100 --nodes 4 --gpus-per-node 8 --link ib-400g --seq-len 4096 "
                "--batch-size 64 --top 3".split()) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# llama-3-8b: 8.03 B parameters") and "4 node(s) x 8 h100 = 32 devices" in out[0]
    assert out[1].split()[:3] == ["rank", "layout", "step"] and len(out) == 7
    assert re.match(r"# \d+ layouts fit, \d+ do not fit the device's memory", out[5])
    assert out[6].startswith("best: dp")


@pytest.mark.timeout(120)
def test_plans_of_an_8b_model_on_4_x_8_devices_answer_within_2_s(capsys):
    from distrain.cli import main

    for argv in ("plan --model llama-3-8b --device h100 --nodes 4 --gpus-per-node 8 --link ib-400g --seq-len 4096",
                 "plan --model llama-3-8b --nodes 4 --procs-per-node 8 --link ib-hdr --intra nvlink3 --compute-ms 1000 "
                 "--seq-len 4096"):
        t0 = time.perf_counter()
        assert main(argv.split()) == 0
        assert time.perf_counter() - t0 < 2.0, argv
    out = capsys.readouterr().out
    assert "layouts fit" in out and "ddp ring" in out


def test_the_coarse_ring_matches_the_fine_simulation_on_the_calibrated_cells():
    from distrain.costmodel.plan import _ring, simulated_allreduce

    for P, link in ((2, "100mbit_2"), (4, "200mbit_4"), (8, "1gbit_8")):  # 1gbit at P=8: with a shared host
        f = calibrated_fabric(str(DATA / f"link_{link}.json"), block_placement(P, 1))
        for size in (1 << 20, 4 << 20, 16 << 20):
            fine = simulated_allreduce(f, [list(range(P))], size, "ring")
            coarse = _ring(f, (tuple(range(P)),), size)
            assert coarse[0] == pytest.approx(fine[0], rel=0.01), (link, size)
            assert coarse[1] == fine[1]  # the busiest link's bytes exactly
    # equal hops (one rank per node, 1 MiB chunks: one piece each): the seeds' 2(P-1)(α + N/(P·B))
    f = Fabric(block_placement(8, 1), LINKS["eth-10g"], INTRA["shm"], 0.0)
    t, _ = collectives.ring_time(f, [list(range(8))], 8 << 20)
    alpha, bw = LINKS["eth-10g"].alpha, LINKS["eth-10g"].bandwidth
    assert t == pytest.approx(2 * 7 * (alpha + (1 << 20) / bw), rel=1e-9)


def test_published_runs_are_predicted_within_the_targets(capsys):
    from distrain.cli import main

    assert main(["plan", "--validate", str(DATA / "published_runs.toml")]) == 0
    out = capsys.readouterr().out
    m = re.search(r"(\d+) runs from (\d+) sources: median \|error\| ([\d.]+) %, max ([\d.]+) %", out)
    runs, sources, median, worst = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert runs >= 8 and sources >= 3
    assert median <= 10.0 and worst <= 25.0, out


@pytest.mark.timeout(120)
def test_the_sustained_efficiencies_are_the_documented_fit():
    from distrain.costmodel import calibration

    runs = calibration.mosaicml_runs(str(DATA / "mosaicml_benchmarks.csv"))
    held = [r for r in runs if calibration.held_out(r)]
    assert len(runs) == 209 and len(held) == 209 - 123 - 32
    assert calibration.fit([r for r in runs if not calibration.held_out(r)]) == devices.SUSTAINED
    d = devices.device("a100")
    g, a, e = devices.SUSTAINED["ampere"]
    s = d.sustained()
    assert (s.gemm_eff, s.fa2_eff, s.mem_eff) == pytest.approx((d.gemm_eff / g, d.fa2_eff / a, d.mem_eff / e))


def test_validation_files_are_checked_row_by_row(tmp_path, capsys):
    from distrain.cli import main

    def err(text):
        p = tmp_path / "runs.toml"
        p.write_text(text)
        assert main(["plan", "--validate", str(p)]) == 2
        return capsys.readouterr().err

    good = ('source = "s"\nconfig = "c"\nmetric = "mfu"\npublished = 0.4\ncommand = "distrain plan --device h100 '
            '--nodes 1 --model llama-3-8b --seq-len 4096 --tp 1 --pp 1 --cp 1 --zero 1 --micro-batch 1 '
            '--recompute none"\n')
    assert "run 1 lacks command" in err('[[run]]\nsource = "s"\nconfig = "c"\nmetric = "mfu"\npublished = 0.4\n')
    assert "run 1 has metric 'speed'" in err("[[run]]\n" + good.replace('"mfu"', '"speed"'))
    assert "run 1's command leaves its layout open" in err("[[run]]\n" + good.replace(" --recompute none", ""))
    assert "no [[run]] tables" in err("x = 1\n")
    p = tmp_path / "one.toml"
    p.write_text("[[run]]\n" + good)
    assert main(["plan", "--validate", str(p)]) == 0
    assert "1 runs from 1 sources" in capsys.readouterr().out


def test_devices_have_sources_and_the_host_measures_itself():
    for name, d in devices.DEVICES.items():
        assert d.source and d.bf16_flops > 0 and d.memory > 0 and 0 < d.gemm_eff <= 1, name
    assert devices.device("A100") is devices.DEVICES["a100-80g"]
    assert devices.device("a100-40g").attn_eff("fa3") == devices.device("a100-40g").fa2_eff  # no FA3 on Ampere
    with pytest.raises(ConfigError, match="unknown device"):
        devices.device("v100")
    got = devices.measure_host(seconds=0.05, threads=1)
    assert got["fp32_flops"] > 1e8 and got["bf16_flops"] > 1e7 and got["mem_bw"] > 1e8 and got["threads"] == 1
