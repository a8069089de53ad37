#!/bin/bash
# llama-moe-tiny: one process vs ddp2 vs ep2 (P=2), and ddp4, ep2 x dp2, ep4 (P=4), alternated over 2 rounds
cd /work/main
OUT=${OUT:-runs/bench_moe}; rm -rf $OUT; mkdir -p $OUT
for round in 1 2; do
  for cfg in "single 1 1" "ddp 2 1" "ddp 2 2" "ddp 4 1" "ddp 4 2" "ddp 4 4"; do
    set -- $cfg
    name=${1}_p${2}_ep${3}_r$round
    args="--strategy $1 --nproc $2"; [ "$3" != 1 ] && args="$args --ep $3"
    .venv/bin/distrain train --model llama-moe-tiny $args --steps 40 --batch-size 16 --eval-every 0 --sample-chars 0 \
       --out $OUT/$name --overwrite > $OUT/$name.log 2>&1 || echo "FAIL $name"
  done
done
OUT=$OUT .venv/bin/python - <<'PY'
import json, glob, os, statistics, collections
by = collections.defaultdict(list)
for f in sorted(glob.glob(os.environ.get("OUT", "runs/bench_moe") + "/*/metrics.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    ts = [r["time"] for r in rows if "loss" in r]; t = [b - a for a, b in zip(ts, ts[1:])][10:]
    name = f.split("/")[-2].rsplit("_r", 1)[0]
    if t: by[name].append(statistics.median(t))
    last = [r["loss"] for r in rows if "loss" in r][-1]
    print(f, len(t), last)
for k, v in by.items(): print(k, [round(x * 1e3, 1) for x in v])
PY
