"""The training-step benchmarks: real training jobs or their pieces, measured side by side.

    throughput.py         distrain bench train: data-parallel throughput per strategy
    zero.py               distrain bench zero: memory per rank and step time, DDP and ZeRO
    ps.py                 distrain bench ps: synchronous parameter-server rounds
    layouts.py            distrain bench layouts: every layout (dp, tp, pp, ZeRO) on one model
    layout_plan.py        its --layouts parsed and the jobs planned from them (pure)
    step_predict.py       measured step time of run folders beside distrain plan's prediction
    activation_memory.py  memory kept for backward with and without activation checkpointing
"""
