"""distrain.parallel.zero: ZeRO data parallelism (Rajbhandari et al., SC'20) on distrain.comm.

    layout.py       flat units, padded shards of S = ceil(N/P), traffic formulas
    stage12.py      stages 1-2: optimizer state (and gradients) sharded, buckets reduce-scattered
    stage3.py       stage 3: parameters sharded, gathered per layer with prefetch, freed after
    engine.py       Zero: the public engine (step, clipping, checkpoints)
    consolidate.py  the engine's state as the whole-model form (distrain.checkpoint.form) and back
    memory.py       measured bytes per rank and the paper's formulas
"""

from distrain.parallel.zero.engine import STAGES, Zero
from distrain.parallel.zero.layout import FlatUnit

__all__ = ["FlatUnit", "STAGES", "Zero"]
