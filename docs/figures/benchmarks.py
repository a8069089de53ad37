"""Draw the figures of docs/benchmarks.md from the raw JSON records under docs/.

    .venv/bin/python docs/figures/benchmarks.py          # writes docs/figures/bench_*.png

Every number drawn is read from a JSON file that `distrain bench ...` wrote (the file is named in
each panel's title or in docs/benchmarks.md beside the figure); nothing is typed in here except
which files and which rows to draw. Files drawn:

* bench_collectives.png: busbw against size. (a) P=2 all_reduce, shm slots / symmetric memory /
  Gloo, its Python kernels and DeepSpeed's op (docs/bench_compiled/allreduce_quiet_{1,2}.json,
  2026-11-27); (b, c) broadcast, all_gather and reduce_scatter at P=2 and P=4, shm against Gloo
  (docs/bench_compiled/ops.json, 2026-11-27); (d) our star/ring/tree all_reduce over Gloo against Gloo's own (docs/bench_comm.json,
  2026-11-22).
* bench_training.png: step time of local / ddp / zero2 / torch DDP on gpt-small at P=2 with 0, 2, 4
  busy processes (docs/bench_load/train4_gpt_bg*.json); step time and peak RSS beside FSDP2
  (docs/bench_load/zero4_gpt_fsdp.json), both 2026-11-26; held state bytes per rank of every ZeRO
  stage and torch's (docs/bench_zero.json, 2026-11-23).
* bench_layouts.png: llama-small throughput over one process, Gloo against shm
  (docs/bench_load/layouts_llama_lay_*.json), and every layout at P=2 and 4 with one thread per rank
  (docs/bench_layouts_llama_threads1.json), both 2026-11-25.
* bench_elastic.png: elastic / fixed step time per round, and recovery / join seconds
  (docs/bench_elastic/*.json, 2026-11-27).
* bench_pipeline.png: idle time over the ideal compute of GPipe, 1F1B, interleaved 1F1B and ZB-H1
  against their formulas (docs/bench_pipeline_zb.json, 2026-11-23).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
OUT = DOCS / "figures"

plt.rcParams.update({"font.size": 10, "axes.titlesize": 10.5, "legend.fontsize": 8.5,
                     "axes.grid": True, "grid.alpha": 0.3, "savefig.dpi": 110})

COLORS = {"gloo": "#7f7f7f", "shm": "#1f77b4", "sym": "#d62728", "star": "#2ca02c", "ring": "#ff7f0e",
          "tree": "#9467bd", "local": "#bcbd22", "ddp": "#1f77b4", "zero2": "#17becf",
          "torch-ddp": "#7f7f7f", "torch-fsdp": "#8c564b"}
OP_COLORS = {"all_reduce": "#1f77b4", "all_gather": "#ff7f0e", "reduce_scatter": "#2ca02c", "broadcast": "#d62728"}


def load(rel: str) -> dict | list:
    return json.loads((DOCS / rel).read_text())


def size_label(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("message size (bytes of the full buffer)")
    ax.set_ylabel("busbw GB/s (log)")


def series(records, **match):
    """[(size, busbw)] of the records whose fields equal ``match``, by size."""
    rows = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return sorted((r["size_bytes"], r["busbw_GBps"]) for r in rows)


def plot_series(ax, pts, **kw):
    ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", ms=3.5, **kw)


# ---------------------------------------------------------------- collectives

def collectives():
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.6))

    ax = axes[0][0]
    for run, style in ((1, "-"), (2, ":")):
        recs = load(f"bench_compiled/allreduce_quiet_{run}.json")["records"]
        label = run == 1
        for transport, color, name in (("shm+sym", COLORS["sym"], "shm, symmetric memory"),
                                       ("shm", COLORS["shm"], "shm, compiled, through the slots"),
                                       ("shm-python", COLORS["tree"], "shm, Python kernels"),
                                       ("deepspeed", COLORS["ring"], "DeepSpeed's C++ shm op"),
                                       ("torch", COLORS["gloo"], "Gloo")):
            plot_series(ax, series(recs, transport=transport), color=color, ls=style, label=name if label else None)
    sizes = [s for s, _ in series(recs, transport="torch")]
    size_axis(ax, sizes)
    ax.set_title("(a) all_reduce, P=2, float32, quiet (2026-11-27 04:05)\n"
                 "solid: run 1, dotted: run 2 (bench_compiled/allreduce_quiet_*.json)")
    ax.legend(loc="lower right", fontsize=7.5)

    ops = load("bench_compiled/ops.json")["records"]
    for ax, P in ((axes[0][1], 2), (axes[1][0], 4)):
        for op, color in OP_COLORS.items():
            if op == "all_reduce":
                continue
            plot_series(ax, series(ops, P=P, op=op, transport="shm"), color=color, ls="-", label=op)
            plot_series(ax, series(ops, P=P, op=op, transport="torch"), color=color, ls="--", mfc="white")
        ax.plot([], [], color="k", ls="-", marker="o", ms=3.5, label="shm (compiled)")
        ax.plot([], [], color="k", ls="--", marker="o", ms=3.5, mfc="white", label="Gloo")
        size_axis(ax, [s for s, _ in series(ops, P=P, op="broadcast", transport="torch")])
        note = "" if P == 2 else ", 4 ranks on 2 cores"
        ax.set_title(f"({'b' if P == 2 else 'c'}) broadcast, all_gather, reduce_scatter, P={P}{note}\n"
                     f"shm (solid) vs Gloo (dashed), 2026-11-27 (bench_compiled/ops.json)")
        ax.legend(loc="lower right", ncol=2, fontsize=7.5)

    ax = axes[1][1]
    recs = load("bench_comm.json")["records"]
    for algo in ("native", "star", "ring", "tree"):
        color = COLORS["gloo"] if algo == "native" else COLORS[algo]
        name = "Gloo (native)" if algo == "native" else f"our {algo} (on Gloo P2P)"
        for P, style in ((2, "-"), (4, "--")):
            plot_series(ax, series(recs, P=P, op="all_reduce", algorithm=algo), color=color, ls=style,
                        label=f"{name}, P={P}")
    size_axis(ax, [s for s, _ in series(recs, P=2, op="all_reduce", algorithm="native")])
    ax.set_title("(d) all_reduce over Gloo: our algorithms vs Gloo's own\n"
                 "2026-11-22, solid P=2, dashed P=4 (bench_comm.json)")
    ax.legend(loc="lower right", ncol=2, fontsize=7.5)

    fig.tight_layout()
    fig.savefig(OUT / "bench_collectives.png")
    plt.close(fig)


# ---------------------------------------------------------------- training

def bars(ax, groups, names, values, colors, width=0.8, fmt="{:.0f}", fontsize=7.5):
    """Grouped bars: values[name][i] for group i; a missing value (None) leaves a gap."""
    n = len(names)
    w = width / n
    for j, name in enumerate(names):
        xs = [i - width / 2 + w * (j + 0.5) for i in range(len(groups))]
        vals = values[name]
        for x, v in zip(xs, vals):
            if v is None:
                continue
            ax.bar(x, v, w, color=colors[j], label=name if x == xs[0] or vals[0] is None else None)
            ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=fontsize)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)


def training():
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.9), gridspec_kw={"width_ratios": [1.3, 0.9, 1.3]})

    ax = axes[0]
    names = ["local", "ddp@shm", "zero2@shm", "torch-ddp"]
    vals = {n: [] for n in names}
    groups = []
    for N in (0, 2, 4):
        recs = {r["strategy"]: r for r in load(f"bench_load/train4_gpt_bg{N}.json")["records"]}
        groups.append(f"{N} busy processes")
        for n in names:
            vals[n].append(recs[n]["step_ms"])
    bars(ax, groups, ["local (no exchange)", "ddp (shm)", "zero2 (shm)", "torch DDP (Gloo)"],
         dict(zip(["local (no exchange)", "ddp (shm)", "zero2 (shm)", "torch DDP (Gloo)"], vals.values())),
         [COLORS["local"], COLORS["ddp"], COLORS["zero2"], COLORS["torch-ddp"]])
    ax.set_ylabel("step ms (median of 4 rounds; lower is better)")
    ax.set_title("(a) gpt-small, P=2, global batch 24: step time\n2026-11-26 (bench_load/train4_gpt_bg{0,2,4}.json)")
    ax.legend(loc="upper left")
    ax.set_ylim(0, max(max(v) for v in vals.values()) * 1.15)

    ax = axes[1]
    recs = load("bench_load/zero4_gpt_fsdp.json")["records"]
    labels = {"ddp": "ddp\n(shm)", "zero2": "zero2\n(shm)", "torch-ddp": "torch\nDDP", "torch-fsdp": "torch\nFSDP2"}
    xs = range(len(recs))
    ax.bar(xs, [r["step_ms"] for r in recs], 0.6, color=[COLORS[r["strategy"]] for r in recs])
    for x, r in zip(xs, recs):
        ax.text(x, r["step_ms"], f"{r['step_ms']:.0f} ms\n{r['peak_mem_bytes'] / 1e6:.0f} MB", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([labels[r["strategy"]] for r in recs])
    ax.set_ylim(0, max(r["step_ms"] for r in recs) * 1.3)
    ax.set_ylabel("step ms (bars); peak RSS per rank in the label")
    ax.set_title("(b) gpt-small, P=2, beside FSDP2\n2026-11-26 (bench_load/zero4_gpt_fsdp.json)")

    ax = axes[2]
    recs = load("bench_zero.json")["records"]
    xs = list(range(len(recs)))
    bottom = [0.0] * len(recs)
    for part, color in (("params_bytes", "#1f77b4"), ("grads_bytes", "#ff7f0e"), ("optimizer_bytes", "#2ca02c")):
        h = [r[part] / 1e6 for r in recs]
        ax.bar(xs, h, 0.6, bottom=bottom, color=color, label=part.replace("_bytes", "").replace("params", "parameters")
               .replace("grads", "gradients").replace("optimizer", "AdamW state"))
        bottom = [b + v for b, v in zip(bottom, h)]
    ax.plot(xs, [r["peak_mem_bytes"] / 1e6 for r in recs], "kD", ms=5, label="peak RSS above start")
    for x, total, r in zip(xs, bottom, recs):
        ax.text(x, total + 4, f"{total:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([r["strategy"].replace("torch-", "torch\n") for r in recs])
    ax.set_ylabel("MB per rank (max over ranks)")
    ax.set_ylim(0, max(r["peak_mem_bytes"] for r in recs) / 1e6 * 1.4)
    ax.set_title(f"(c) held state per rank, GPT of {recs[0]['psi'] / 1e6:.1f} M parameters, P=2\n"
                 "2026-11-23 (bench_zero.json)")
    ax.legend(loc="upper center", ncol=2, fontsize=7.5)

    fig.tight_layout()
    fig.savefig(OUT / "bench_training.png")
    plt.close(fig)


# ---------------------------------------------------------------- layouts

def layouts():
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.1), gridspec_kw={"width_ratios": [1.15, 1.4, 1.4]})

    ax = axes[0]
    runs = [("Gloo run 1", "torch_1"), ("Gloo run 2", "torch_2"), ("shm run 1", "shm_1"), ("shm run 2", "shm_2")]
    lays = ["ddp", "zero2", "tp2"]
    vals = {}
    for name, tag in runs:
        recs = {r["layout"]: r for r in load(f"bench_load/layouts_llama_lay_{tag}.json")["records"]}
        vals[name] = [recs[lay]["samples_per_s"] / recs["single"]["samples_per_s"] for lay in lays]
    bars(ax, [f"{lay} P=2" for lay in lays], [n for n, _ in runs], vals,
         ["#bbbbbb", "#7f7f7f", "#9ecae1", "#1f77b4"], fmt="{:.2f}", fontsize=7)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_ylabel("samples/s over one process (2 threads)")
    ax.set_ylim(0, 1.35)
    ax.set_title("(a) llama-small, P=2: Gloo vs shm, quiet\n2026-11-25 07:55 (bench_load/layouts_llama_lay_*.json)")
    ax.legend(loc="upper right", fontsize=7.5)

    recs = load("bench_layouts_llama_threads1.json")["records"]
    single = next(r for r in recs if r["layout"] == "single")
    rest = [r for r in recs if r["layout"] != "single"]
    def grid(r):  # dp2×tp1×pp1 -> dp2: the sizes above 1
        return "×".join(part for part in r["grid"].split("×") if not part.endswith("1") or part[-2:-1].isdigit())

    def name(r):  # the layout, and its grid where that says more
        lay = r["layout"].split(" ")[0]
        return lay if grid(r) == lay.replace("x", "×") else f"{lay}\n{grid(r)}"

    names = [name(r) for r in rest]
    colors = ["#1f77b4" if r["nproc"] == 2 else "#ff7f0e" for r in rest]
    xs = list(range(len(rest)))

    ax = axes[1]
    sp = [r["samples_per_s"] / single["samples_per_s"] for r in rest]
    ax.bar(xs, sp, 0.65, color=colors)
    for x, v in zip(xs, sp):
        ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=8.5)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("samples/s over one process (1 thread)")
    ax.bar([0], [0], color="#1f77b4", label="P=2")
    ax.bar([0], [0], color="#ff7f0e", label="P=4 (4 ranks on 2 cores)")
    ax.legend(loc="upper right")
    ax.set_title("(b) llama-small, every layout, one thread per rank (Gloo)\n"
                 "2026-11-25 03:41, load 5-6 (bench_layouts_llama_threads1.json)")

    ax = axes[2]
    mem = [r["peak_mem_bytes"] / 1e6 for r in rest]
    ax.bar(xs, mem, 0.65, color=colors)
    for x, v in zip(xs, mem):
        ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(single["peak_mem_bytes"] / 1e6, color="k", lw=1, ls="--")
    ax.text(len(rest) - 0.5, single["peak_mem_bytes"] / 1e6 + 2, "one process", ha="right", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=8.5)
    ax.set_ylim(0, single["peak_mem_bytes"] / 1e6 * 1.2)
    ax.set_ylabel("peak RSS MB per rank (max over ranks)")
    ax.set_title("(c) the same runs: peak memory per rank\nblue P=2, orange P=4 (4 ranks on 2 cores)")

    fig.tight_layout()
    fig.savefig(OUT / "bench_layouts.png")
    plt.close(fig)


# ---------------------------------------------------------------- elastic

ELASTIC = [("ddp, MLP,\nbefore", "ddp-before"), ("ddp, MLP", "ddp"), ("ddp,\ngpt-small", "ddp-gpt-small"),
           ("zero2, MLP,\nbefore", "zero2-before"), ("zero2, MLP", "zero2"), ("ps-sync,\nMLP", "ps-sync")]


def elastic():
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    summaries = [(name, load(f"bench_elastic/{tag}.json")["meta"]["summary"]) for name, tag in ELASTIC]
    xs = list(range(len(summaries)))

    ax = axes[0]
    for x, (name, s) in zip(xs, summaries):
        color = "#7f7f7f" if "before" in name else "#1f77b4"
        ax.plot([x] * len(s["ratios"]), s["ratios"], "o", color=color, alpha=0.45, ms=5)
        ax.plot([x - 0.25, x + 0.25], [s["ratio_median"]] * 2, color=color, lw=2.5)
        ax.text(x + 0.28, s["ratio_median"], f"{s['ratio_median']:.3f}", va="center", fontsize=8)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(xs)
    ax.set_xticklabels([n for n, _ in summaries], fontsize=8)
    ax.set_xlim(-0.5, len(xs) - 0.2)
    ax.set_ylabel("elastic step / fixed step")
    ax.set_title("(a) cost of --elastic 3:4 with no fault, P=4: each round (dots), median (bar)\n"
                 "grey: the code before the one runtime (2026-11-27, bench_elastic/*.json)")

    ax = axes[1]
    w = 0.38
    rec = [s["recover_s"] for _, s in summaries]
    join = [s["join_s"] for _, s in summaries]
    ax.bar([x - w / 2 for x in xs], rec, w, color="#1f77b4", label="rank killed: kill to the next step at P=3")
    ax.bar([x + w / 2 for x in xs], join, w, color="#ff7f0e", label="killed and replaced: the newcomer's join_s")
    for x, a, b in zip(xs, rec, join):
        ax.text(x - w / 2, a, f"{a:.2f}", ha="center", va="bottom", fontsize=7.5)
        ax.text(x + w / 2, b, f"{b:.2f}", ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(xs)
    ax.set_xticklabels([n for n, _ in summaries], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, max(join) * 1.3)
    ax.set_title("(b) recovery and join, rank id 1 killed at step 30\n(one measurement each)")
    ax.legend(loc="upper right")

    fig.tight_layout()
    fig.savefig(OUT / "bench_elastic.png")
    plt.close(fig)


# ---------------------------------------------------------------- pipeline

def pipeline():
    rows = load("bench_pipeline_zb.json")
    order = ["gpipe", "1f1b", "interleaved 1F1B v=2", "zb-h1"]
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    cells = sorted({(r["p"], r["m"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.3))
    w = 0.8 / len(order)
    for j, (sched, color) in enumerate(zip(order, colors)):
        for i, cell in enumerate(cells):
            r = next(r for r in rows if (r["p"], r["m"]) == cell and r["schedule"] == sched)
            x = i - 0.4 + w * (j + 0.5)
            ax.bar(x, r["over_ideal"], w, color=color, label=sched if i == 0 else None)
            ax.plot([x - w / 2, x + w / 2], [r["expected_over_ideal"]] * 2, color="k", lw=1.5,
                    label="formula" if i == 0 and j == 0 else None)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"p={p}, m={m}" for p, m in cells])
    ax.set_ylabel("idle time / ideal compute (median of 5)")
    ax.set_title("Pipeline schedules: measured idle time (bars) against the formula (black line)\n"
                 "sleep workload, loaded 2-core machine, 2026-11-23 (bench_pipeline_zb.json)")
    ax.legend(ncol=5, loc="upper left", fontsize=8)
    ax.set_ylim(0, max(r["over_ideal"] for r in rows) * 1.2)
    fig.tight_layout()
    fig.savefig(OUT / "bench_pipeline.png")
    plt.close(fig)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for draw in (collectives, training, layouts, elastic, pipeline):
        draw()
        print(f"wrote docs/figures/bench_{draw.__name__}.png")


if __name__ == "__main__":
    main()
