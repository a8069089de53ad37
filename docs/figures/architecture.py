"""Draw docs/architecture.png: the layers of src/distrain and one training step's path through them.

    .venv/bin/python docs/figures/architecture.py          # writes docs/architecture.png

Left: the layer stack, read from the LAYERS table of tests/test_import_graph.py (the table the
import checks enforce), lowest rank at the bottom; each box names its folder or file under
src/distrain/, boxes of one rank side by side (siblings: neither imports the other). Middle: one
training step as hops in time order, a dot on the row of every layer a hop runs in. Right: what each
hop is (file and function). Blue: every job (fixed or elastic); orange: what an elastic job adds.
The hops are written here by hand (docs/architecture.md walks through the same numbers); the
rows, folders and file lists come from the code, so a new layer or a moved folder shows up when the
script runs again.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "architecture.png"


def load_layers():
    """tests/test_import_graph.py as a module (LAYERS, modules(), layer(), SRC): the standard library only."""
    spec = importlib.util.spec_from_file_location("test_import_graph", ROOT / "tests" / "test_import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = load_layers()
SRC: Path = G.SRC

# one line on what each layer holds (a layer missing here is drawn with its folder alone)
WHAT = {
    "distrain.errors": "exception types: ConfigError, CommError, PeerLostError, ...",
    "distrain.comm.core": "groups, tags, p2p, Transport, ledger, watchdog, failures",
    "distrain.comm.algorithms": "star, ring, tree, cost",
    "distrain.comm.shm": "shared-memory transport",
    "distrain.comm": "api, dispatch, forms, ...: the torch.distributed surface",
    "distrain.runtime": "init(): backend, process group, device",
    "distrain.launch": "spawn (local.py), the one Supervisor, torchrun",
    "distrain.parallel": "parallelize(), DDP, ZeRO, PS",
    "distrain.elastic": "coordinator, nodes, member",
    "distrain.models": "a folder per model + plan",
    "distrain.data": "data sets, tokenizers, sampler",
    "distrain.costmodel": "alpha-beta simulator",
    "distrain.checkpoint": "sets, reshard, import/export",
    "distrain.trainer": "config, checks/, loop, guard, engines/, metrics",
    "distrain.cluster": "emulated cluster: netns, veth, tc",
    "distrain": "the Python API, distrain generate, old import paths",
    "distrain.bench": "one folder per benchmark tool",
    "distrain.cli": "the distrain command: one module per command",
    "distrain.__main__": "python -m distrain",
}

BLUE, ORANGE, GREY = "#1f5fbf", "#d9680b", "#6b6b6b"
FILL = {  # by rank: a few families of colour
    0: "#eeeeee", 1: "#eeeeee", 2: "#dcefdc", 3: "#dcefdc", 4: "#dcefdc", 5: "#fbf3d5", 6: "#fbf3d5",
    7: "#dde8f7", 8: "#efe2f5", 9: "#f7e3de", 10: "#fde8c8", 11: "#e6e6e6", 12: "#e6e6e6", 13: "#e6e6e6",
    14: "#e3f1f1", 15: "#e3f1f1",
}

# the hops of one training step: (id, layers it runs in, in call order; title; what happens)
HOPS = {
    "1": (["distrain.cli"], "cli/train.py  run",
          "the flags are TrainConfig's fields (trainer/config.py); the run lock; train(cfg)"),
    "2": (["distrain.trainer"], "trainer/loop.py  train",
          "validates the config and --out; a fixed job: spawn(_spawned, cfg.nproc)"),
    "3": (["distrain.launch", "distrain.runtime"], "launch/local.py  spawn  ->  launch/supervisor.py  Supervisor",
          "one process per rank; each opens the process group (runtime.py init)"),
    "4": (["distrain.trainer", "distrain.checkpoint", "distrain.models", "distrain.data"],
          "trainer/loop.py  run_rank",
          "new_model (checkpoint/init_from.py -> models/registry.py); build_task (data/)"),
    "5": (["distrain.trainer", "distrain.models", "distrain.parallel", "distrain.optim"],
          "trainer/guard.py  Guard.enter  ->  make_engine  ->  build_engine",
          "trainer/engines/grid.py: Topology + parallelize() (the plans: models/<name>/plan.py); "
          "the optimizer from optim.py"),
    "6": (["distrain.trainer", "distrain.data"], "trainer/loop.py  train_steps  (every step)",
          "guard.begin; data/sampler.py part(step, dp_rank, dp_size): this rank's share"),
    "7": (["distrain.trainer", "distrain.parallel", "distrain.comm", "distrain.comm.algorithms",
           "distrain.comm.core"], "engine.train_step  (trainer/engines/grid.py)",
          "forward, backward; parallel/ syncs the gradients: comm/api.py, dispatch.py -> algorithms/ "
          "(ring, tree, star), shm/ or native Gloo/NCCL -> comm/core/"),
    "8": (["distrain.trainer"], "commit hook, then the update",
          "the guard's commit hook (a fixed job: none), then the optimizer step"),
    "9": (["distrain.trainer", "distrain.checkpoint"], "guard.end;  after(step)",
          "the loss summed (report.py), metrics.jsonl (metrics.py), evaluation, checkpoint/store.py save_set"),
    "A": (["distrain.elastic", "distrain.launch"], "elastic/coordinator.py  run  (in place of 3)",
          "a Coordinator on the same Supervisor (elastic/ranks.py starts each rank); other nodes: "
          "elastic/nodes.py node agents"),
    "B": (["distrain.trainer", "distrain.elastic", "distrain.comm"],
          "ElasticGuard.enter  ->  elastic/member.py  Member.join",
          "opens the first group; a newcomer joins at a step boundary, healed from a peer"),
    "C": (["distrain.trainer", "distrain.elastic"], "guard.begin  ->  Member.begin",
          "notes the RNG; ZeRO: a copy of its piece goes to the next rank (elastic/pieces.py)"),
    "D": (["distrain.trainer", "distrain.elastic", "distrain.comm"], "commit hook  ->  Member.commit / agreed",
          "between gradient sync and update: [loss, change wanted], in DDP's last bucket or one all-reduce"),
    "E": (["distrain.comm.core", "distrain.errors", "distrain.trainer", "distrain.elastic"],
          "a peer lost:  comm/core/failures.py  lost  ->  PeerLostError",
          "the loop catches it; guard.failed -> Member.failed: by type, not by message"),
    "F": (["distrain.trainer", "distrain.elastic"], "guard.keep  ->  guard.recover  ->  Member.reform",
          "the coordinator picks members and step (roll back or forward); a new group, a new engine "
          "(make_engine) with that state; on from C"),
}
TIME_ORDER = ["1", "2", "3", "A", "4", "B", "5", "C", "6", "7", "D", "8", "9", "E", "F"]
FIXED = [h for h in TIME_ORDER if h.isdigit()]
PHASES = [("start (once)", "1", "5"), ("every step", "C", "9"), ("on a change", "E", "F")]


def label_of(prefix: str) -> str:
    """The folder or file(s) a layer is, under src/distrain/."""
    rel = prefix.split(".")[1:]
    if not rel:  # the package's own modules: those no deeper layer claims
        mods = sorted(m for m in G.modules() if G.layer(m) == "distrain")
        return "  ".join(("__init__" if m == "distrain" else m.split(".")[-1]) + ".py" for m in mods)
    path = SRC.joinpath(*rel)
    if not path.is_dir():
        return "/".join(rel) + ".py"
    inner = [p.split(".")[len(rel) + 1] for p in G.LAYERS if p.startswith(prefix + ".")]
    inner = [n + ("/" if (path / n).is_dir() else ".py") for n in inner]
    return "/".join(rel) + "/" + (f"  (not {' '.join(inner)})" if inner else "")


def rows() -> dict[int, list[str]]:
    by_rank: dict[int, list[str]] = {}
    for prefix, rank in G.LAYERS.items():
        by_rank.setdefault(rank, []).append(prefix)
    return dict(sorted(by_rank.items()))


def wrap_line(prefixes: list[str], limit: int) -> list[list[str]]:
    """Siblings in lines of at most ``limit`` characters of labels (a rank of many small files wraps)."""
    lines, cur, n = [], [], 0
    for p in prefixes:
        k = len(label_of(p)) + 3
        if cur and n + k > limit:
            lines.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += k
    return lines + [cur]


def draw() -> Path:
    fig = plt.figure(figsize=(14, 9), dpi=110)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 9)
    ax.axis("off")

    # -- geometry (inches) --------------------------------------------------------------------
    x0, x1 = 0.45, 4.75  # the layer boxes
    s0, s1 = 4.9, 8.05  # the swimlane (one column per hop)
    l0 = 8.2  # the hop list
    y_bot, y_top, y_head = 0.55, 7.95, 8.07
    ranks = rows()
    lines = {r: wrap_line(ps, 66) for r, ps in ranks.items()}
    unit = (y_top - y_bot) / sum(len(ls) for ls in lines.values())
    box_y: dict[str, float] = {}  # each layer's centre height

    ax.text(0.15, 8.72, "distrain: the layers (left, lowest at the bottom) and one training step through them",
            fontsize=13, weight="bold", va="center")
    ax.text(0.15, 8.42, "Rows: the ranks of LAYERS in tests/test_import_graph.py. A module imports its own box or a "
            "lower row, never a higher row or a box beside it. Folders are under src/distrain/.", fontsize=9,
            color=GREY, va="center")
    ax.text(0.30, y_head, "rank", fontsize=9, color=GREY, ha="center", va="bottom")
    ax.text(x0 + 0.1, y_head, "layer (its folder or file)", fontsize=9, color=GREY, va="bottom")

    y = y_bot
    for rank, ls in lines.items():
        h_row = unit * len(ls)
        ax.text(0.30, y + h_row / 2, str(rank), fontsize=9, color=GREY, ha="center", va="center")
        for i, line in enumerate(reversed(ls)):  # the first line on top
            ly = y + i * unit
            described = len(ls) == 1
            weights = [max(len(label_of(p)), int(len(WHAT.get(p, "")) * 0.9) if described else 0, 8) + 2
                       for p in line]
            gap = 0.06
            width = x1 - x0 - gap * (len(line) - 1)
            bx = x0
            for p, wt in zip(line, weights):
                bw = width * wt / sum(weights)
                edge = ORANGE if p == "distrain.elastic" else "#8a8a8a"
                ax.add_patch(FancyBboxPatch((bx, ly + 0.035), bw, unit - 0.07,
                                            boxstyle="round,pad=0,rounding_size=0.05", fc=FILL.get(rank, "#eeeeee"),
                                            ec=edge, lw=1.4 if edge == ORANGE else 0.8))
                what = WHAT.get(p, "") if described else ""
                if what:
                    ax.text(bx + 0.07, ly + unit * 0.68, label_of(p), fontsize=9.5, weight="bold", va="center")
                    ax.text(bx + 0.07, ly + unit * 0.30, what, fontsize=9, va="center", color="#333333")
                else:
                    ax.text(bx + bw / 2, ly + unit / 2, label_of(p), fontsize=9.5, ha="center", va="center")
                box_y[p] = ly + unit / 2
                bx += bw + gap
        # the row continued across the swimlane
        ax.add_patch(Rectangle((s0, y + 0.035), s1 - s0, h_row - 0.07, fc=FILL.get(rank, "#eeeeee"), ec="none",
                               alpha=0.45, zorder=0))
        y += h_row

    # -- the swimlane -----------------------------------------------------------------------------
    dx = (s1 - s0) / len(TIME_ORDER)
    col = {h: s0 + dx * (i + 0.5) for i, h in enumerate(TIME_ORDER)}
    for name, a, b in PHASES:
        xa, xb = col[a] - dx / 2, col[b] + dx / 2
        ax.add_patch(Rectangle((xa + 0.02, y_bot - 0.02), xb - xa - 0.04, y_top - y_bot + 0.04, fc="none",
                               ec="#9a9a9a", lw=0.8, ls=(0, (2, 2)), zorder=1))
        ax.text((xa + xb) / 2, y_head, name, fontsize=9, ha="center", va="bottom", color="#333333")

    def pt(h, k=0):
        return col[h], box_y[HOPS[h][0][k]]

    def arrow(p, q, colour, dashed=False, rad=0.0, width=1.6):
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=10, color=colour, lw=width,
                                     ls=(0, (3, 2)) if dashed else "-", shrinkA=7, shrinkB=7,
                                     connectionstyle=f"arc3,rad={rad}", zorder=3))

    for h in TIME_ORDER:  # a hop: from the layer it enters to every layer it reaches (dots)
        colour = BLUE if h.isdigit() else ORANGE
        ys = [box_y[p] for p in HOPS[h][0]]
        ax.plot([col[h]] * 2, [min(ys), max(ys)], color=colour, lw=2.0, zorder=2, solid_capstyle="round",
                ls="-" if h.isdigit() else (0, (3, 2)))
        for yy in ys[1:]:
            ax.plot(col[h], yy, "o", ms=5, color=colour, zorder=4)
    # every job: 1 -> 2 -> ... -> 9, from where each hop enters to where the next one does
    for a, b in zip(FIXED, FIXED[1:]):
        arrow(pt(a), pt(b), BLUE)
    # an elastic job: A in place of 3; a lost peer (E, raised in comm/core/ under 7), then the change (F)
    for a, b, k in [("2", "A", 0), ("A", "4", 0), ("7", "E", -1), ("E", "F", -1)]:
        arrow(pt(a, k), pt(b), ORANGE, dashed=True)
    spine = box_y["distrain.trainer"]
    arrow(pt("9"), pt("6"), BLUE, rad=0.6, width=1.3)  # the next step
    ax.text((col["6"] + col["9"]) / 2, spine + 0.29, "next step", fontsize=9, color=BLUE, ha="center", va="bottom")
    arrow(pt("F"), pt("C"), ORANGE, dashed=True, rad=0.8, width=1.3)  # on from the agreed step
    ax.text((col["C"] + col["F"]) / 2, spine + 0.66, "on from the agreed step", fontsize=9, color=ORANGE,
            ha="center", va="bottom")
    for h in TIME_ORDER:  # the hop's id where it enters
        colour = BLUE if h.isdigit() else ORANGE
        x, yy = pt(h)
        ax.add_patch(plt.Circle((x, yy), 0.095, fc="white", ec=colour, lw=1.6, zorder=5))
        ax.text(x, yy, h, fontsize=9, weight="bold", color=colour, ha="center", va="center", zorder=6)

    # -- the hop list -------------------------------------------------------------------------------
    order = FIXED + [h for h in TIME_ORDER if not h.isdigit()]
    yy = y_top - 0.14
    step = 0.158
    for h in order:
        if h == "1":
            ax.text(l0, yy, "Every job (fixed, and elastic with A in place of 3):", fontsize=9.5, color=BLUE,
                    weight="bold", va="center")
            yy -= 0.24
        if h == "A":
            yy -= 0.04
            ax.text(l0, yy, "What an elastic job adds (distrain train --elastic MIN:MAX):", fontsize=9.5,
                    color=ORANGE, weight="bold", va="center")
            yy -= 0.24
        colour = BLUE if h.isdigit() else ORANGE
        _, title, what = HOPS[h]
        ax.add_patch(plt.Circle((l0 + 0.1, yy), 0.095, fc="white", ec=colour, lw=1.6))
        ax.text(l0 + 0.1, yy, h, fontsize=9, weight="bold", color=colour, ha="center", va="center")
        ax.text(l0 + 0.28, yy, title, fontsize=9, weight="bold", va="center")
        body = textwrap.wrap(what, 80)
        for k, line in enumerate(body):
            ax.text(l0 + 0.28, yy - step * (k + 1), line, fontsize=9, va="center", color="#333333")
        yy -= step * (len(body) + 1) + 0.075

    # legend
    ax.plot([s0, s0 + 0.35], [0.28, 0.28], color=BLUE, lw=2.0)
    ax.text(s0 + 0.42, 0.28, "every job", fontsize=9, va="center")
    ax.plot([s0 + 1.3, s0 + 1.65], [0.28, 0.28], color=ORANGE, lw=2.0, ls=(0, (3, 2)))
    ax.text(s0 + 1.72, 0.28, "elastic job only", fontsize=9, va="center")
    ax.text(x0, 0.28, "circle: where a hop enters; dot: a layer it runs in", fontsize=9, color=GREY, va="center")

    fig.savefig(OUT, dpi=110)
    plt.close(fig)
    return OUT


if __name__ == "__main__":
    print(draw())
