"""``distrain bench wan`` (bench/wan/, cli/bench_wan.py): DDP against the DiLoCo forms across an emulated WAN.

Fast: what a run folder says (curve, bytes, compute utilisation), seconds to a target loss, the records'
ratios, the table and the targets, the strategy table's train flags, and every refusal in one line before
any cluster exists. Slow (root): the whole bench scaled down on 2 emulated nodes, its JSON, PNG and the
ledger's exact bytes.
"""

from __future__ import annotations

import json
import os

import pytest

from distrain.bench.wan import report, runs
from distrain.cli import main
from distrain.cluster import netns
from distrain.cluster.fixture import remove_stale
from distrain.errors import TrainingError

P = report.Point


def _run(strategy: str, curve: list[tuple[int, float, float]], bytes_per_node: int, wall_s: float,
         util: float | None = 0.5, steps: int = 10) -> report.Run:
    """A Run of ``steps`` steps of 100 tokens whose curve points are (step, seconds, val_loss)."""
    return report.Run(strategy, strategy, steps, 100, tuple(P(s, (s + 1) * 100, t, v) for s, t, v in curve), wall_s,
                      wall_s + 1.0, bytes_per_node, util, None)


def test_seconds_to_target_is_the_first_evaluation_at_or_below_it_and_none_when_never():
    curve = [P(4, 500, 2.0, 3.0), P(9, 1000, 4.0, 2.5), P(14, 1500, 6.0, 2.4), P(19, 2000, 8.0, 2.6)]
    assert report.seconds_to_target(curve, 2.5) == 4.0  # equal counts as reached
    assert report.seconds_to_target(curve, 2.45) == 6.0  # the first below, not the last (2.6 comes after)
    assert report.seconds_to_target(curve, 3.5) == 2.0
    assert report.seconds_to_target(curve, 2.39) is None
    assert report.seconds_to_target([], 1.0) is None


def _write_run(folder, lines: list[dict], summary: dict) -> None:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "summary.json").write_text(json.dumps(summary))


def test_read_run_takes_the_curve_bytes_and_utilisation_from_the_run_folder(tmp_path):
    lines = [{"step": 0, "time_s": 0.5, "comm_wait_s": 0.25, "tokens_per_s": 256.0},
             {"step": 1, "time_s": 0.25, "comm_wait_s": 0.0, "tokens_per_s": 512.0, "val_loss": 3.0},
             {"event": "membership", "step": 2},  # (not a step line)
             {"step": 2, "time_s": 0.25, "comm_wait_s": 0.0, "tokens_per_s": 512.0},
             {"step": 3, "time_s": 1.0, "comm_wait_s": 0.75, "tokens_per_s": 128.0, "val_loss": 2.5}]
    _write_run(tmp_path / "d", lines, {"steps": 4, "label": "diloco (K=2×1, H=2)", "wall_s": 2.5,
                                       "bytes_sent_per_step_rank0": 16944.5, "outer_syncs": 2})
    r = report.read_run(tmp_path / "d", "diloco")
    assert r == report.Run("diloco", "diloco (K=2×1, H=2)", 4, 128, (P(1, 256, 0.75, 3.0), P(3, 512, 2.0, 2.5)),
                           2.0, 2.5, 67778, 1.0 - 1.0 / 2.0, 2)


@pytest.mark.parametrize("lines, summary, message", [
    ([{"step": 0, "time_s": 0.5, "comm_wait_s": 0.0, "tokens_per_s": 2.0}], {"steps": 1},
     "no validation loss after the last step; run with --eval-every"),
    ([{"step": 1, "time_s": 0.5, "tokens_per_s": 2.0, "val_loss": 1.0}], {"steps": 1},
     "expected one line per step 0, 1, 2, ..."),
    ([{"step": 0, "time_s": 0.5, "tokens_per_s": 2.0, "val_loss": 1.0}], {"steps": 2},
     "1 step lines, summary.json says 2"),
    ([{"step": 0, "time_s": "x", "tokens_per_s": 2.0, "val_loss": 1.0}], {"steps": 1},
     "time_s is 'x', not a finite number"),
])
def test_read_run_refuses_a_folder_it_cannot_trust(tmp_path, lines, summary, message):
    _write_run(tmp_path / "r", lines, summary)
    with pytest.raises(TrainingError, match=message.replace(".", r"\.").replace("(", r"\(")):
        report.read_run(tmp_path / "r", "ddp")


def test_read_run_names_a_missing_folder(tmp_path):
    with pytest.raises(TrainingError, match="bench wan: ddp: cannot read the run in"):
        report.read_run(tmp_path / "nowhere", "ddp")


def _three() -> list[dict]:
    ddp = _run("ddp", [(4, 5.0, 3.0), (9, 10.0, 2.0)], 1_000_000, 10.0, util=0.25)
    diloco = _run("diloco", [(4, 0.5, 2.5), (9, 1.0, 1.96)], 100_000, 1.0)  # 2.0 reached at 1.0 s
    int8 = _run("diloco-int8", [(4, 0.4, 2.9), (9, 0.8, 2.1)], 5_000, 0.8, util=None)  # never reaches 2.0
    return report.records([ddp, diloco, int8])


def test_records_compare_each_run_with_ddps_final_loss_bytes_and_time():
    ddp, diloco, int8 = _three()
    assert [r["target_val_loss"] for r in (ddp, diloco, int8)] == [2.0, 2.0, 2.0]
    assert (ddp["seconds_to_target"], ddp["faster_to_target_than_ddp"], ddp["fewer_bytes_than_ddp"]) == (10.0, 1.0, 1.0)
    assert diloco["val_loss_vs_ddp"] == pytest.approx(-0.02)
    assert (diloco["fewer_bytes_than_ddp"], diloco["seconds_to_target"], diloco["faster_to_target_than_ddp"]) == \
        (10.0, 1.0, 10.0)
    assert int8["val_loss_vs_ddp"] == pytest.approx(0.05)
    assert (int8["fewer_bytes_than_ddp"], int8["seconds_to_target"], int8["faster_to_target_than_ddp"]) == \
        (200.0, None, None)
    assert (diloco["tokens"], diloco["wall_s"], diloco["run_s"]) == (1000, 1.0, 2.0)
    assert (ddp["ddp_seconds_to_this_loss"], diloco["ddp_seconds_to_this_loss"], int8["ddp_seconds_to_this_loss"]) \
        == (10.0, None, 10.0)
    assert diloco["curve"][1] == {"step": 9, "tokens": 1000, "seconds": 1.0, "val_loss": 1.96}
    with pytest.raises(ValueError, match="no ddp run"):
        report.records([_run("diloco", [(9, 1.0, 2.0)], 1, 1.0)])


def test_table_and_targets_say_what_holds():
    recs = _three()
    table = report.format_table(recs, title="t").splitlines()
    assert table[0] == "# t"
    assert table[3].split() == ["ddp", "2.0000", "+0.00%", "1,000,000", "1.0x", "10.0", "10.0", "1.0x", "25"]
    assert table[4].split() == ["diloco", "1.9600", "-2.00%", "100,000", "10.0x", "1.0", "1.0", "10.0x", "50"]
    assert table[5].split() == ["diloco-int8", "2.1000", "+5.00%", "5,000", "200.0x", "0.8", "-", "-", "-"]
    assert report.targets(recs) == [
        {"strategy": "diloco", "loss_within_2pct": True, "bytes_100x": False, "time_5x": True},
        {"strategy": "diloco-int8", "loss_within_2pct": False, "bytes_100x": True, "time_5x": False}]
    assert report.format_targets(recs).splitlines() == [
        "# targets (against ddp)",
        "  diloco: loss within 2 %: yes (-2.00%); >= 100x fewer bytes: no (10.0x); >= 5x less wall time: yes "
        "(10.0x less wall time to ddp's loss)",
        "  diloco-int8: loss within 2 %: no (+5.00%); >= 100x fewer bytes: yes (200.0x); >= 5x less wall time: no "
        "(ddp's final loss never reached; ddp took 10.0 s to this run's final loss, 12.5x this run's 0.8 s)",
        "  all three: no strategy"]


def _longer() -> list[dict]:
    """ddp for 10 steps; diloco for 30 (--target-budget 3), reaching ddp's 2.0 after 20 steps, not at 10."""
    ddp = _run("ddp", [(4, 5.0, 3.0), (9, 10.0, 2.0)], 1_000_000, 10.0, util=0.25)
    diloco = _run("diloco", [(4, 0.5, 2.5), (9, 1.0, 2.1), (14, 1.5, 2.05), (19, 2.0, 1.99), (24, 2.5, 1.9),
                             (29, 3.0, 1.95)], 30_000, 3.0, steps=30)
    int4 = _run("diloco-int4", [(4, 0.4, 2.9), (9, 0.8, 2.6), (19, 1.6, 2.3), (29, 2.4, 2.2)], 3_000, 2.4,
                util=None, steps=30)  # never reaches 2.0
    return report.records([ddp, diloco, int4])


def test_a_longer_run_is_compared_at_ddps_tokens_and_timed_to_ddps_loss_over_all_of_it():
    ddp, diloco, int4 = _longer()
    assert (ddp["steps"], ddp["steps_run"], ddp["tokens"], ddp["tokens_run"]) == (10, 10, 1000, 1000)
    assert (diloco["steps"], diloco["steps_run"], diloco["tokens"], diloco["tokens_run"]) == (10, 30, 1000, 3000)
    # equal tokens: the evaluation after ddp's step 9, not the run's last one
    assert (diloco["val_loss_equal_tokens"], diloco["final_val_loss"]) == (2.1, 1.95)
    assert diloco["val_loss_vs_ddp"] == pytest.approx(0.05)
    assert (diloco["wall_s_equal_tokens"], diloco["wall_s"]) == (1.0, 3.0)
    assert (diloco["bytes_per_node"], diloco["bytes_per_node_run"], diloco["fewer_bytes_than_ddp"]) == \
        (10_000, 30_000, 100.0)
    # the first evaluation at or below 2.0 of the whole run (1.99 after 20 steps), not the lowest (1.9)
    assert (diloco["seconds_to_target"], diloco["steps_to_target"], diloco["tokens_to_target"],
            diloco["faster_to_target_than_ddp"]) == (2.0, 20, 2000, 5.0)
    assert (diloco["ddp_seconds_to_this_loss"], int4["ddp_seconds_to_this_loss"]) == (10.0, 10.0)  # (2.1, 2.6)
    assert (int4["seconds_to_target"], int4["steps_to_target"], int4["tokens_to_target"],
            int4["faster_to_target_than_ddp"]) == (None, None, None, None)
    assert (int4["val_loss_equal_tokens"], int4["final_val_loss"], int4["bytes_per_node"]) == (2.6, 2.2, 1_000)
    assert (ddp["seconds_to_target"], ddp["steps_to_target"], ddp["tokens_to_target"]) == (10.0, 10, 1000)
    assert report.targets([ddp, diloco, int4]) == [
        {"strategy": "diloco", "loss_within_2pct": False, "bytes_100x": True, "time_5x": True},
        {"strategy": "diloco-int4", "loss_within_2pct": False, "bytes_100x": True, "time_5x": False}]


def test_a_run_without_an_evaluation_at_ddps_step_count_has_no_equal_token_loss():
    ddp = _run("ddp", [(9, 10.0, 2.0)], 1_000, 10.0)
    for short in (_run("diloco", [(8, 1.0, 2.1), (19, 2.0, 1.9)], 10, 2.0, steps=20),  # (no point at step 9)
                  _run("diloco", [(4, 1.0, 2.1)], 10, 2.0, steps=5)):  # fewer steps than ddp
        with pytest.raises(ValueError, match=r"records: diloco has no evaluation after step 9 \(ddp's last\)"):
            report.records([ddp, short])


def test_the_table_and_targets_of_a_longer_run_say_how_far_it_went():
    recs = _longer()
    table = report.format_table(recs).splitlines()
    assert table[0].split()[-2:] == ["longer", "run"]
    assert table[1].split()[-6:] == ["compute", "%", "steps", "to", "ddp's", "steps", "wall", "s"][2:]
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert rows["ddp"] == ["ddp", "2.0000", "+0.00%", "1,000,000", "1.0x", "10.0", "10.0", "1.0x", "25", "10", "10",
                           "10.0"]
    assert rows["diloco"] == ["diloco", "2.1000", "+5.00%", "10,000", "100.0x", "1.0", "2.0", "5.0x", "50", "20", "30",
                              "3.0"]
    assert rows["diloco-int4"] == ["diloco-int4", "2.6000", "+30.00%", "1,000", "1,000.0x", "0.8", "-", "-", "-", "-",
                                   "30", "2.4"]
    assert report.format_targets(recs).splitlines()[1:] == [
        "  diloco: loss within 2 %: no (+5.00%); >= 100x fewer bytes: yes (100.0x); >= 5x less wall time: yes "
        "(5.0x less wall time to ddp's loss, reached after 20 steps)",
        "  diloco-int4: loss within 2 %: no (+30.00%); >= 100x fewer bytes: yes (1,000.0x); >= 5x less wall time: "
        "no (ddp's final loss never reached in 30 steps, 3x ddp's; ddp took 10.0 s to this run's equal-token loss, "
        "12.5x this run's 0.8 s)",
        "  all three: no strategy"]


def test_every_strategy_trains_the_same_job_and_differs_only_in_its_table_flags(tmp_path):
    s = runs.Settings(nodes=3, steps=80, inner_steps=40, lr=0.001, strategies=tuple(runs.STRATEGIES))
    cmds = {x: runs.train_command(s, x, tmp_path / x) for x in runs.STRATEGIES}
    common = ["--model", "gpt-small", "--data", "shakespeare", "--steps", "80", "--batch-size", "16", "--seed", "0",
              "--lr", "0.001", "--eval-every", "25", "--eval-batches", "8", "--log-every", "25", "--ckpt-every", "0",
              "--sample-chars", "0", "--no-progress", "--no-report"]
    for x, cmd in cmds.items():
        flags = [f.format(inner_steps=40) for f in runs.STRATEGIES[x]]
        assert cmd == ["distrain", "train", "--nproc", "3", *flags, *common, "--out", str(tmp_path / x), "--overwrite"]
    assert cmds["diloco-int4"][4:11] == ["--strategy", "diloco", "--inner-steps", "40", "--outer-compression", "int4",
                                         "--model"]
    assert cmds["ddp"][4:7] == ["--strategy", "ddp", "--model"]


def test_warm_start_longer_runs_and_outer_flags_change_only_their_flags(tmp_path):
    s = runs.Settings(nodes=2, steps=80, inner_steps=40, strategies=tuple(runs.STRATEGIES), outer_lr=0.5,
                      outer_momentum=0.8, warm_start=30, target_budget=3)
    warm = tmp_path / runs.WARM_START
    base = runs.Settings(nodes=2, steps=80, inner_steps=40)
    for x in ("ddp", "diloco", "diloco-int8", "streaming"):
        cmd, plain = runs.train_command(s, x, tmp_path / x, warm), runs.train_command(base, x, tmp_path / x)
        i = plain.index("--model")
        outer = ["--outer-lr", "0.5", "--outer-momentum", "0.8"] if x != "ddp" else []
        steps = "80" if x == "ddp" else "240"  # the others: 3 x ddp's steps
        rest = plain[i:]
        rest[rest.index("--steps") + 1] = steps
        assert cmd == plain[:i] + outer + rest[:4] + ["--init-from", str(warm)] + rest[4:], x
    # the warm-up: ddp for --warm-start steps, another batch order (seed + 1), no outer flags
    w = runs.warm_command(s, warm)
    assert w[:7] == ["distrain", "train", "--nproc", "2", "--strategy", "ddp", "--model"]
    assert w[w.index("--steps") + 1] == "30" and w[w.index("--seed") + 1] == "1" and "--init-from" not in w
    assert w[w.index("--out") + 1] == str(warm)
    assert [s.steps_of(x) for x in ("ddp", "diloco")] == [80, 240]


@pytest.mark.parametrize("flags, line", [
    (["--nodes", "1"], "bench wan: --nodes 1: the strategies differ only in what crosses the links between nodes; "
                       "give at least 2"),
    (["--strategies", "ddp,streamin"], "bench wan: --strategies: unknown 'streamin'; choose from ddp, diloco, "
                                       "diloco-bf16, diloco-int8, diloco-int4, streaming, streaming-bf16, "
                                       "streaming-int4"),
    (["--strategies", "diloco,diloco-int8"], "bench wan: --strategies must include ddp: every run's target is its "
                                             "final validation loss"),
    (["--steps", "30", "--inner-steps", "20"], "bench wan: --steps 30 must be a multiple of --inner-steps 20, so that "
                                               "every DiLoCo run ends on an outer step (its final model is "
                                               "synchronised)"),
    (["--eval-every", "0"], "bench wan: --eval-every 0 must be in [1, --steps 200]: the curves and the time to ddp's "
                            "loss come from the evaluations"),
    (["--outer-lr", "0"], "bench wan: --outer-lr 0 must be a positive finite number"),
    (["--outer-momentum", "0"], "bench wan: --outer-momentum 0 must be in (0, 1): DiLoCo's Nesterov outer step needs "
                                "momentum"),
    (["--outer-momentum", "1"], "bench wan: --outer-momentum 1 must be in (0, 1): DiLoCo's Nesterov outer step needs "
                                "momentum"),
    (["--warm-start", "-1"], "bench wan: --warm-start -1 must be at least 0 (steps of the ddp run every strategy "
                             "starts from; 0: from scratch)"),
    (["--target-budget", "0"], "bench wan: --target-budget 0 must be at least 1 (times ddp's steps that the other "
                               "strategies train)"),
    (["--target-budget", "2", "--eval-every", "30"], "bench wan: --target-budget 2 needs an evaluation after ddp's "
                                                     "last step: give an --eval-every that divides --steps 200"),
    (["--target-budget", "2", "--strategies", "ddp,diloco,streaming,streaming-int4,streaming-bf16"],
     "bench wan: --target-budget 2 with streaming, streaming-bf16: an overlapped exchange is settled only at a run's "
     "last step, so a longer run's model at ddp's step count is not the equal-token run's; run streaming, "
     "streaming-bf16 with --target-budget 1"),
    (["--delay", "25"], "--delay: bad time '25'; use a number with a unit such as 25ms, 500us, 0.1s, or 0"),
    (["--link", "fast"], "--link: bad rate 'fast'; use tc units such as 100mbit, 1gbit, 10gbit"),
])
def test_bad_input_is_one_line_before_any_cluster(flags, line, capsys, monkeypatch):
    monkeypatch.setattr(netns, "up", lambda spec: pytest.fail("a cluster was built"))
    assert main(["bench", "wan", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"distrain: error: {line}"


def test_without_root_it_says_so_before_any_cluster(capsys, monkeypatch):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "the emulated cluster needs root (network namespaces, "
                                                             "veth pairs and tc); run as root")
    monkeypatch.setattr(netns, "up", lambda spec: pytest.fail("a cluster was built"))
    assert main(["bench", "wan", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("distrain: error: bench wan: the emulated cluster needs root (network "
                                               "namespaces, veth pairs and tc); run as root")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_wan_on_two_nodes_writes_records_png_and_the_ledgers_exact_bytes(tmp_path, monkeypatch):
    """The whole bench, tiny: 2 nodes on 1 Gbit/s and 1 ms, gpt-tiny, from a 4-step ddp warm start, ddp 8 steps
    and the DiLoCo forms 16 (--target-budget 2), DiLoCo H = 4 (2 outer steps at equal tokens)."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from distrain.models import build_model
    from distrain.parallel.diloco import quantized

    remove_stale()
    name = f"dtt{os.getpid()}k9"  # a test cluster's name: remove_stale takes it down if this process dies
    out, png, folders = tmp_path / "wan.json", tmp_path / "wan.png", tmp_path / "runs"
    try:
        assert main(["bench", "wan", "--nodes", "2", "--link", "1gbit", "--delay", "1ms", "--model", "gpt-tiny",
                     "--steps", "8", "--inner-steps", "4", "--eval-every", "4", "--eval-batches", "2", "--batch-size",
                     "8", "--warm-start", "4", "--target-budget", "2", "--name", name, "--json", str(out),
                     "--plot", str(png), "--out", str(folders), "--timeout", "240"]) == 0
    finally:
        left = netns.namespaces(name)
        if left:
            netns.down(name)
    assert left == [], "the bench left its cluster up"
    doc = json.loads(out.read_text())
    recs = {r["strategy"]: r for r in doc["records"]}
    assert list(recs) == ["ddp", "diloco", "diloco-int8", "diloco-int4"]
    types = {"strategy": str, "final_val_loss": float, "val_loss_equal_tokens": float, "bytes_per_node": int,
             "bytes_per_node_run": int, "wall_s": float, "wall_s_equal_tokens": float, "tokens": int, "tokens_run": int,
             "steps": int, "steps_run": int, "run_s": float, "target_val_loss": float, "val_loss_vs_ddp": float,
             "fewer_bytes_than_ddp": float, "curve": list}
    for r in recs.values():
        for key, t in types.items():
            assert type(r[key]) is t, (r["strategy"], key, r[key])
        assert 0 < r["compute_utilisation"] <= 1
        longer = 1 if r["strategy"] == "ddp" else 2
        assert (r["steps"], r["tokens"], r["target_val_loss"]) == (8, 8 * 8 * 16, recs["ddp"]["final_val_loss"])
        assert (r["steps_run"], r["tokens_run"]) == (8 * longer, 8 * longer * 8 * 16)
        assert [p["step"] for p in r["curve"]] == [3, 7, 11, 15][:2 * longer]
        assert r["curve"][-1]["val_loss"] == r["final_val_loss"] and r["curve"][-1]["seconds"] == r["wall_s"]
        # equal tokens: the evaluation after ddp's step count (step 7), wherever the run went on
        assert (r["val_loss_equal_tokens"], r["wall_s_equal_tokens"]) == (r["curve"][1]["val_loss"],
                                                                           r["curve"][1]["seconds"])
        assert r["val_loss_vs_ddp"] == r["val_loss_equal_tokens"] / r["target_val_loss"] - 1.0
        # null when no evaluation of the whole run reaches ddp's final loss, else the first one's, within the run
        reached = [p for p in r["curve"] if p["val_loss"] <= r["target_val_loss"]]
        assert (r["seconds_to_target"], r["steps_to_target"], r["tokens_to_target"]) == (
            (reached[0]["seconds"], reached[0]["step"] + 1, reached[0]["tokens"]) if reached else (None, None, None))
        assert r["seconds_to_target"] is None or 0 < r["seconds_to_target"] <= r["wall_s"]
        ddp_there = [p for p in recs["ddp"]["curve"] if p["val_loss"] <= r["val_loss_equal_tokens"]]
        assert r["ddp_seconds_to_this_loss"] == (ddp_there[0]["seconds"] if ddp_there else None)
        assert r["bytes_per_node_run"] == longer * r["bytes_per_node"]
        # every run started from the warm-up's weights
        config = json.loads((folders / r["strategy"] / "config.json").read_text())
        assert (config["init_from"], config["steps"]) == (str(folders / runs.WARM_START), 8 * longer)
    assert recs["ddp"]["seconds_to_target"] == recs["ddp"]["wall_s"]  # ddp reaches its own final loss at its end
    warm = json.loads((folders / runs.WARM_START / "config.json").read_text())
    assert (warm["strategy"], warm["steps"], warm["seed"], warm["init_from"]) == ("ddp", 4, 1, "")
    assert doc["meta"]["warm_start_val_loss"] == report.read_run(folders / runs.WARM_START, "ddp").curve[-1].val_loss
    # the ledger's bytes at equal tokens, exactly: DDP's ring sends 2(P-1)/P x 4N per step, DiLoCo the same once
    # every H steps, int8/int4 the quantized exchange's payload once every H steps
    n = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    assert recs["ddp"]["bytes_per_node"] == 8 * 4 * n
    assert recs["diloco"]["bytes_per_node"] == recs["ddp"]["bytes_per_node"] // 4 == 2 * 4 * n
    assert recs["diloco-int8"]["bytes_per_node"] == 2 * quantized.sync_bytes(n, 2, 8)
    assert recs["diloco-int4"]["bytes_per_node"] == 2 * quantized.sync_bytes(n, 2, 4)
    assert doc["meta"]["cluster"] == {"nodes": 2, "link_bits_per_s": 1e9, "delay_us_one_way": 1000, "rtt_ms": 2.0,
                                      "mtu": 9000}
    assert [t["strategy"] for t in doc["meta"]["targets"]] == ["diloco", "diloco-int8", "diloco-int4"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the longer run's model at ddp's step count is the equal-token run's: diloco trained for 8 steps alone (here,
    # outside the cluster: the same arithmetic, one OpenMP thread per rank as cluster run gives) evaluates the same
    alone = tmp_path / "diloco-8"
    same = runs.Settings(nodes=2, model="gpt-tiny", steps=8, inner_steps=4, eval_every=4, eval_batches=2, batch_size=8)
    cmd = runs.train_command(same, "diloco", alone, folders / runs.WARM_START)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (the local launcher gives each rank OMP_NUM_THREADS threads)
    assert main(cmd[1:]) == 0  # in this process: a fresh interpreter took seconds of imports
    assert report.read_run(alone, "diloco").curve[-1].val_loss == recs["diloco"]["val_loss_equal_tokens"]
