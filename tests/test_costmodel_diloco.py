"""DiLoCo against DDP in the cost model (distrain.costmodel.diloco, ``distrain plan --inner-steps``).

* The rows equal the α-β formula by hand: a ring all-reduce of n bytes on K equal hops takes
  2(K − 1)(α + n/(K·B)) + (K − 1)·γ·n/K; DDP's step (one bucket, --compute-ms) is compute + that; DiLoCo's
  is compute + that / H (n halved in bf16), plus the outer step's seconds per parameter / H.
* The bytes per node per step are the traffic ledger's: 2(K − 1)/K · 4N for DDP, 1/H of it for DiLoCo (the
  numbers docs/slow_links.md measured for gpt-tiny; a slow test runs a real 2-island job and a DDP one).
* The crossover: t_ddp(b*) = 2 · t_diloco(b*) within 1e-6 relative on the full model (buckets overlapped
  with backward, two ranks per node), and the closed form where nothing overlaps; DDP's balance point.
* The command prints the table (exact cells) with presets and with a calibration, and refuses bad input
  before any output; on a preset the outer step's time is measured.
* Streaming DiLoCo (``--fragments P --overlap-steps tau``): the step equals the hand formula
  C + Σ_p (max(0, t_p − τ·C) + outer·n_p) / H where no exchange waits for another, Σ_p t_p / H where they
  queue on the link, DiLoCo's row with one fragment and no overlap; the peak step bytes are the largest
  fragment's all-reduce (gpt-tiny's real fragments; a slow test checks a real run's ledger); the table's
  cells and the refusals.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import train_losses, trainer_config

K, N, T, BATCH = 4, 100_000, 0.1, 32  # 4 nodes, 100,000 parameters (one 400 kB bucket), 100 ms of compute


def _setup():
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, ModelSpec

    return ModelSpec("n", N), preset_fabric(K, 1, "eth-1g"), Compute.linear(T, BATCH)


def ring(nbytes: float, alpha: float, B: float, gamma: float, P: int = K) -> float:
    """The ring all-reduce of nbytes on P equal hops, by hand."""
    return 2 * (P - 1) * (alpha + nbytes / P / B) + (P - 1) * gamma * nbytes / P


def test_rows_equal_the_alpha_beta_formula():
    from distrain.costmodel import diloco
    from distrain.costmodel.links import DEFAULT_GAMMA, LINKS

    m, fabric, c = _setup()
    a, B = LINKS["eth-1g"].alpha, LINKS["eth-1g"].bandwidth
    C = T / K  # each rank's B / K samples
    fp32, bf16 = ring(4 * N, a, B, DEFAULT_GAMMA), ring(2 * N, a, B, DEFAULT_GAMMA)
    ddp = diloco.ddp_row(m, fabric, c, BATCH)
    assert ddp.step_s == pytest.approx(C + fp32, rel=1e-12) and ddp.comm_s == pytest.approx(fp32, rel=1e-12)
    assert ddp.node_bytes == 2 * (K - 1) / K * 4 * N == 600_000
    for H in (1, 10, 100):
        row = diloco.diloco_row(m, fabric, c, BATCH, H)
        assert row.step_s == pytest.approx(C + fp32 / H, rel=1e-12)
        assert row.node_bytes == 600_000 / H
        half = diloco.diloco_row(m, fabric, c, BATCH, H, "bf16", outer=1e-8)  # the outer step: 10 ns a parameter
        assert half.step_s == pytest.approx(C + (bf16 + 1e-8 * N) / H, rel=1e-12)
        assert half.node_bytes == 300_000 / H and half.strategy == f"diloco H={H} bf16"


def test_bytes_per_node_are_the_ledgers_measured_ones():
    """docs/slow_links.md's ledger for gpt-tiny on 2 ranks: 271,104 bytes a step (DDP), 33,888 (H = 8),
    16,944 (bf16); two ranks per node send twice as much across for DiLoCo (every rank's cross group)."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, model_spec

    m, c = model_spec("gpt-tiny", None), Compute.linear(T, BATCH)
    two = preset_fabric(2, 1, "eth-1g")
    assert diloco.ddp_row(m, two, c, BATCH).node_bytes == 271_104
    assert diloco.diloco_row(m, two, c, BATCH, 8).node_bytes == 33_888
    assert diloco.diloco_row(m, two, c, BATCH, 8, "bf16").node_bytes == 16_944
    four = preset_fabric(4, 2, "eth-1g")  # 2 nodes x 2 ranks: DDP's ring crosses each node link once
    assert diloco.ddp_row(m, four, c, BATCH).node_bytes == 2 * 3 / 4 * 4 * m.params
    assert diloco.diloco_row(m, four, c, BATCH, 8).node_bytes == 2 * 33_888


def test_the_crossover_closed_form_and_the_balance():
    from distrain.costmodel import diloco
    from distrain.costmodel.links import DEFAULT_GAMMA, LINKS

    m, fabric, c = _setup()
    a, C, f = LINKS["eth-1g"].alpha, T / K, diloco.PAYS
    A = lambda n: 2 * (K - 1) * a + (K - 1) * DEFAULT_GAMMA * n / K  # noqa: E731
    V = lambda n: 2 * (K - 1) / K * n  # noqa: E731
    for H, comp, n_o in ((10, None, 4 * N), (100, "bf16", 2 * N)):
        b = diloco.crossover(m, fabric, c, BATCH, H, compression=comp)
        want = (V(4 * N) - f * V(n_o) / H) / ((f - 1) * C + f * A(n_o) / H - A(4 * N))
        assert b == pytest.approx(want, rel=1e-9)
    assert diloco.ddp_balance(m, fabric, c, BATCH) == pytest.approx(V(4 * N) / (C - A(4 * N)), rel=1e-9)
    # DiLoCo is never slower (no outer cost): it "pays" 1x everywhere; with H = 1 it is DDP, never 2x faster
    assert diloco.crossover(m, fabric, c, BATCH, 10, factor=1.0) == math.inf
    assert diloco.crossover(m, fabric, c, BATCH, 1) == 0.0


def test_the_crossover_on_the_full_model_with_overlap():
    """gpt-small's buckets overlapped with backward, 2 nodes x 2 ranks (DDP inside an island, 2 cross groups
    sharing each node link): t_ddp(b*) = 2 · t_diloco(b*), faster by more below, less above."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, model_spec

    m, c = model_spec("gpt-small", None), Compute.linear(T, BATCH)
    fabric = preset_fabric(4, 2, "eth-1g")
    ratio = lambda b: (diloco.ddp_row(m, diloco.with_bandwidth(fabric, b), c, BATCH).step_s  # noqa: E731
                       / diloco.diloco_row(m, diloco.with_bandwidth(fabric, b), c, BATCH, 50, outer=2e-9).step_s)
    b = diloco.crossover(m, fabric, c, BATCH, 50, outer=2e-9)
    assert 1e6 < b < 1e9
    assert ratio(b) == pytest.approx(2.0, rel=1e-6)
    assert ratio(b / 1.01) > 2.0 > ratio(b * 1.01)
    bal = diloco.ddp_balance(m, fabric, c, BATCH)
    p = diloco.plan_ddp(m, diloco.with_bandwidth(fabric, bal), c, BATCH, "ring")
    assert p.comm_s == pytest.approx(p.compute_s, rel=1e-6) and bal > b


# int8/int4 bytes by hand: 782 blocks of 128 -> chunks of 196, 196, 196, 194 blocks (25,088 x 3 and 24,736
# values); int8 payloads 25,872 / 25,512 bytes, so rank 0 sends 2 x 25,872 + 25,512 + 3 x 25,872 = 154,872 per
# sync (15,487 a step at H = 10); int4: 13,328 / 13,144, 79,784 per sync (7,978)
TABLE = """\
# DiLoCo: 4 islands (one per node, 1 rank(s) each), the outer all-reduce every H steps (ring); DDP: ring over all 4 ranks
strategy                   step ms   compute      comm  bytes/node/step  peak step bytes
ddp ring                     30.47     25.00      5.47          600,000          600,000
diloco H=10                  25.55     25.00      0.55           60,000          600,000
diloco H=10 bf16             25.29     25.00      0.29           30,000          300,000
diloco H=10 int8             25.16     25.00      0.16           15,487          154,872
diloco H=10 int4             25.10     25.00      0.10            7,978           79,784
diloco H=100                 25.05     25.00      0.05            6,000          600,000
diloco H=100 bf16            25.03     25.00      0.03            3,000          300,000
diloco H=100 int8            25.02     25.00      0.02            1,549          154,872
diloco H=100 int4            25.01     25.00      0.01              798           79,784
# DiLoCo H=10 pays below 155.5 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=10 bf16 pays below 175.0 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=10 int8 pays below 184.4 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=10 int4 pays below 189.3 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=100 pays below 191.0 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=100 bf16 pays below 192.9 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=100 int8 pays below 193.9 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
# DiLoCo H=100 int4 pays below 194.4 Mbit/s per node for this model (DDP's communication equals its compute at 194.9 Mbit/s)
"""


def test_plan_inner_steps_command(capsys, tmp_path):
    from distrain.cli import main
    from distrain.costmodel import diloco
    from distrain.costmodel.plan import Compute, ModelSpec
    from distrain.costmodel.links import calibrated_fabric

    flags = ["--params", str(N), "--compute-ms", str(T * 1e3), "--nodes", str(K)]
    assert main(["plan", *flags, "--link", "eth-1g", "--inner-steps", "10", "100"]) == 0
    out = capsys.readouterr().out
    assert TABLE in out  # by hand: 25 ms + 5.47 ms (the ring above), 155.5 Mbit/s the closed form's b*
    # a calibration: the link of docs/cost_model_data (100 Mbit/s netem, 4 nodes), its b* the model's
    cal = "docs/cost_model_data/link_100mbit_4.json"
    assert main(["plan", *flags, "--calibration", cal, "--inner-steps", "20"]) == 0
    out = capsys.readouterr().out
    b = diloco.crossover(ModelSpec("n", N), calibrated_fabric(cal, range(K)), Compute.linear(T, BATCH), BATCH, 20)
    assert f"# DiLoCo H=20 pays below {diloco.mbit(b)} per node" in out and "diloco H=20 bf16" in out
    for argv, message in (([*flags, "--inner-steps", "0"], "--inner-steps 0: give H >= 1"),
                          (["--params", "1000", "--compute-ms", "1", "--nodes", "1", "--procs-per-node", "2",
                            "--inner-steps", "10"], "DiLoCo: plan needs at least 2 nodes"),
                          (["--model", "llama-3-8b", "--device", "h100", "--inner-steps", "10"],
                           "--inner-steps plans DiLoCo on emulated nodes")):
        assert main(["plan", *argv]) == 2
        got = capsys.readouterr()
        assert message in got.err and got.out == ""  # refused before the ranking is printed


def test_the_outer_step_is_measured_on_a_preset():
    """Without --compute-ms the outer step's seconds per parameter (OuterStep.sync: Δ, Nesterov SGD, the copy
    back) is measured: above zero and below 1 µs a parameter (gpt-tiny's 67,776 take well under 70 ms)."""
    from distrain.costmodel import diloco

    assert 0.0 < diloco.measure_outer("gpt-tiny") < 1e-6


def test_streaming_rows_equal_the_hand_formula():
    """--params 100,000 in P = 4 fragments of 25,000 on links of 1 MB/s (each exchange 150 ms, longer than the
    25 ms step, shorter than the 25 steps between two): t = C + Σ_p (max(0, t_p − τ·C) + outer·n_p) / H."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import DEFAULT_GAMMA, LINKS

    m, fabric, c = _setup()
    slow = diloco.with_bandwidth(fabric, 1e6)
    a, C, H, out = LINKS["eth-1g"].alpha, T / K, 100, 1e-8
    assert diloco.fragment_sizes(m, 4) == [25_000] * 4
    for comp, elem in ((None, 4), ("bf16", 2)):
        t_p = ring(elem * 25_000, a, 1e6, DEFAULT_GAMMA)
        for tau in (0, 1, 3, 7):
            row = diloco.streaming_row(m, slow, c, BATCH, H, 4, tau, comp, outer=out)
            assert row.step_s == pytest.approx(C + 4 * (max(0.0, t_p - tau * C) + out * 25_000) / H, rel=1e-12)
            assert row.comm_s == pytest.approx(4 * t_p / H, rel=1e-12)
            assert row.compute_s == pytest.approx(C + out * N / H, rel=1e-12)
            assert row.node_bytes == 2 * 3 / 4 * elem * N / H and row.peak_bytes == 2 * 3 / 4 * elem * 25_000
            assert row.strategy == f"streaming H={H} P=4 tau={tau}" + (f" {comp}" if comp else "")
    # one fragment, no overlap: DiLoCo's row, cell for cell (the name aside)
    for comp in diloco.COMPRESSIONS:
        one, whole = diloco.streaming_row(m, slow, c, BATCH, 10, 1, 0, comp), diloco.diloco_row(m, slow, c, BATCH,
                                                                                                  10, comp)
        assert (one.step_s, one.compute_s, one.node_bytes, one.peak_bytes) == pytest.approx(
            (whole.step_s, whole.compute_s, whole.node_bytes, whole.peak_bytes), rel=1e-12)


def test_streaming_exchanges_queue_on_a_slow_link():
    """H = 4, P = 4: a fragment sent after every step. At 100 kB/s an exchange (1.5 s) outlasts 60 steps, so
    with τ = 3 they queue and the link sets the step (Σ_p t_p / H); blocking (τ = 0) adds them to compute."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import DEFAULT_GAMMA, LINKS

    m, fabric, c = _setup()
    slow = diloco.with_bandwidth(fabric, 1e5)
    t_p = ring(4 * 25_000, LINKS["eth-1g"].alpha, 1e5, DEFAULT_GAMMA)
    assert diloco.streaming_row(m, slow, c, BATCH, 4, 4, 3).step_s == pytest.approx(4 * t_p / 4, rel=1e-12)
    assert diloco.streaming_row(m, slow, c, BATCH, 4, 4, 0).step_s == pytest.approx(T / K + t_p, rel=1e-12)
    # the schedule on its own: one exchange of 10 s every 4 steps of 1 s, τ = 2, one fragment: 1 + (10 - 2) / 4
    assert diloco.streaming_step(1.0, [10.0], [0.0], 4, 2) == pytest.approx(3.0, rel=1e-12)
    # P > H: fragments 0, 1 share offset 0 (and 2, 3 offset 1); they are sent together, so the peak is two
    two = diloco.streaming_row(m, fabric, c, BATCH, 2, 4, 0)
    assert two.peak_bytes == 2 * (2 * 3 / 4 * 4 * 25_000) and two.node_bytes == 600_000 / 2


def test_streaming_peak_bytes_are_the_real_fragments():
    """gpt-tiny in 4 fragments (17,152 / 16,928 / 16,992 / 16,704 parameters, as training cuts it), 2 islands:
    the peak step is the largest fragment's ring all-reduce, 4 × 17,152 = 68,608 bytes (2 × in bf16; the
    measured runs of docs/slow_links.md), the bytes per step DiLoCo's 33,888."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, model_spec

    m, c, two = model_spec("gpt-tiny", None), Compute.linear(T, BATCH), preset_fabric(2, 1, "eth-1g")
    assert diloco.fragment_sizes(m, 4) == [17_152, 16_928, 16_992, 16_704]
    row = diloco.streaming_row(m, two, c, BATCH, 8, 4, 0)
    assert (row.peak_bytes, row.node_bytes) == (68_608, 33_888)
    half = diloco.streaming_row(m, two, c, BATCH, 8, 4, 1, "bf16")
    assert (half.peak_bytes, half.node_bytes) == (2 * 17_152, 16_944)
    # 2 nodes x 2 ranks: both cross groups send their fragment over the node's link
    assert diloco.streaming_row(m, preset_fabric(4, 2, "eth-1g"), c, BATCH, 8, 4, 0).peak_bytes == 2 * 68_608
    assert diloco.diloco_row(m, two, c, BATCH, 8).peak_bytes == 271_104


# the streaming rows by hand: 4 fragments of 25,000 (100,000 bytes: each exchange 1.37 ms, hidden by one 25 ms
# step at tau = 1); bytes per step DiLoCo's (int8: 38,720 per fragment's sync, 4 x that / 10 = 15,488); the peak
# a fragment's 2 x 3/4 x 100,000 = 150,000 (int8 38,720)
STREAMING = """\
strategy                        step ms   compute      comm  bytes/node/step  peak step bytes
ddp ring                          30.47     25.00      5.47          600,000          600,000
diloco H=10                       25.55     25.00      0.55           60,000          600,000
diloco H=10 bf16                  25.29     25.00      0.29           30,000          300,000
diloco H=10 int8                  25.16     25.00      0.16           15,487          154,872
diloco H=10 int4                  25.10     25.00      0.10            7,978           79,784
streaming H=10 P=4 tau=1          25.00     25.00      0.64           60,000          150,000
streaming H=10 P=4 tau=1 bf16     25.00     25.00      0.38           30,000           75,000
streaming H=10 P=4 tau=0 int8     25.25     25.00      0.25           15,488           38,720
streaming H=10 P=4 tau=0 int4     25.19     25.00      0.19            7,979           19,948
"""


def test_plan_streaming_command(capsys):
    from distrain.cli import main

    flags = ["--params", str(N), "--compute-ms", str(T * 1e3), "--nodes", str(K), "--link", "eth-1g"]
    assert main(["plan", *flags, "--inner-steps", "10", "--fragments", "4", "--overlap-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert STREAMING in out
    # fully hidden, it pays where DDP's communication equals its compute (then DDP's step is twice compute)
    assert ("# Streaming DiLoCo H=10 P=4 tau=1 pays below 194.9 Mbit/s per node for this model (DDP's "
            "communication equals its compute at 194.9 Mbit/s)") in out
    assert "# Streaming DiLoCo H=10 P=4 tau=0 int8 pays below" in out
    for argv, message in (([*flags, "--fragments", "4"], "--fragments/--overlap-steps plan Streaming DiLoCo: give "
                                                         "--inner-steps"),
                          ([*flags, "--inner-steps", "10", "--overlap-steps", "1"], "--overlap-steps 1: give "
                                                                                    "--fragments P as well"),
                          ([*flags, "--inner-steps", "10", "20", "--fragments", "4", "--overlap-steps", "10"],
                           "--overlap-steps must be in 0..--inner-steps - 1 = 9"),
                          ([*flags, "--inner-steps", "10", "--fragments", "0"], "--fragments must be in 1..100000"),
                          (["--model", "gpt-tiny", "--compute-ms", "10", "--nodes", "2", "--inner-steps", "10",
                            "--fragments", "70"], "--fragments 70: the model has 69 parameter tensors"),
                          (["--model", "llama-3-8b", "--device", "h100", "--fragments", "4"],
                           "--inner-steps plans DiLoCo on emulated nodes")):
        assert main(["plan", *argv]) == 2
        got = capsys.readouterr()
        assert message in got.err and got.out == ""  # refused before the ranking is printed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_predicted_bytes_equal_a_real_runs_ledger(tmp_path):
    """A 2-island gpt-tiny run (float32, H = 3, 6 steps) and a DDP one: the ledger's bytes per step of rank 0
    (node 0) are the planner's bytes per node per step."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, model_spec

    m, c, fabric = model_spec("gpt-tiny", None), Compute.linear(T, BATCH), preset_fabric(2, 1, "eth-1g")
    want = {"diloco": diloco.diloco_row(m, fabric, c, BATCH, 3).node_bytes,
            "ddp": diloco.ddp_row(m, fabric, c, BATCH).node_bytes}
    for strategy, extra in (("diloco", dict(inner_steps=3)), ("ddp", {})):
        out = tmp_path / strategy
        train_losses(trainer_config(out, strategy=strategy, nproc=2, steps=6, dtype="float32", **extra))
        s = json.loads((out / "summary.json").read_text())
        assert s["bytes_sent_per_step_rank0"] == want[strategy]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_streaming_bytes_equal_a_real_runs_ledger(tmp_path):
    """A 2-island gpt-tiny Streaming DiLoCo run (float32, H = 4, P = 4, τ = 0, 8 steps): the ledger's bytes per
    step and its peak step bytes of rank 0 are the planner's."""
    from distrain.costmodel import diloco
    from distrain.costmodel.links import preset_fabric
    from distrain.costmodel.plan import Compute, model_spec

    m, c, fabric = model_spec("gpt-tiny", None), Compute.linear(T, BATCH), preset_fabric(2, 1, "eth-1g")
    row = diloco.streaming_row(m, fabric, c, BATCH, 4, 4, 0)
    train_losses(trainer_config(tmp_path, strategy="diloco", nproc=2, steps=8, dtype="float32", inner_steps=4,
                                fragments=4))
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["bytes_sent_per_step_rank0"], s["peak_step_bytes_rank0"]) == (row.node_bytes, row.peak_bytes)
    assert (row.node_bytes, row.peak_bytes) == (271_104 / 4, 68_608)
