"""distrain.bench: the benchmarks, one folder per ``distrain bench`` tool (or group of tools).

    comm/       distrain bench comm: collectives.py (flags, ranks, report), timing.py (the
                per-rank side), report.py (nccl-tests conventions, tables, plot), predict.py
                (--predict: the cost model beside each measurement; bench predict for its table)
    link/       distrain bench link: calibrate.py (alpha, beta of every link, gamma of the adds)
    pipeline/   distrain bench pipeline: bubbles.py (measured bubble against the formula)
    tp/         distrain bench tp: blocks.py (all-reduce payload and activation bytes per block)
    train/      training-step tools: throughput.py (distrain bench train), zero.py (bench zero),
                ps.py (bench ps), layouts.py + layout_plan.py (bench layouts), step_predict.py
                (measured steps beside distrain plan), activation_memory.py (checkpointing)
    wan/        distrain bench wan: runs.py (a cluster of its own, one training run per strategy
                across it), report.py (curves, bytes, time to DDP's loss, table, targets, figure)
    common.py   sizes, statistics, metadata, JSON and tables every tool shares
    background.py  --background-load N: busy processes beside a benchmark (comm and train)

The command line (distrain/cli/bench.py, cli/bench_comm.py for comm and link, and cli/bench_studies.py for the studies behind the
documents' tables: cp-memory, activation-memory, predict, step-predict) parses every tool's
flags and calls the tool's typed ``run``; no module here parses ``argv``.
"""
