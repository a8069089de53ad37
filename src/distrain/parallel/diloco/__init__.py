"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models").

The ranks form K islands of M ranks each (``islands(world, K)``: island i is ranks i*M .. i*M + M - 1,
data parallel inside over their fast links). Each island takes H inner optimizer steps on its own part of
each global batch; then the islands synchronise: the outer gradient Δ = θ_prev − θ_island (the parameter
change since the last sync) is averaged over the islands and an outer optimizer step (SGD, or SGD with
Nesterov momentum) is taken on θ_prev, the outer parameters; every island starts its next H steps from the
result. Each island's inner optimizer state stays its own.

    islands.py   which ranks form which island, and the two families of groups (IslandGroups)
    outer.py     OuterStep: the outer parameters θ_prev, the outer optimizer, the averaged outer gradient
                 (one all-reduce across the islands, counted by distrain.comm's ledger)
    quantized.py the outer gradient in 8 or 4 bits (block-wise absmax), averaged in two exchanges
    exact.py     the mean as an int64 sum at per-tensor exponents shared by the islands (--layout-invariant:
                 its bits depend on the K outer gradients alone)
    streaming.py Streaming DiLoCo: the parameters in P fragments synchronised at staggered offsets, each
                 exchange optionally overlapped with τ inner steps (StreamingOuter: an OuterStep per fragment)

Imports distrain.comm, and distrain.parallel.invariant's fixed-point primitives (exact.py).
"""

from distrain.parallel.diloco.islands import IslandGroups, island_labels, island_ranks, live_islands
from distrain.parallel.diloco.outer import OUTER_COMPRESSIONS, OUTER_OPTIMIZERS, OuterStep
from distrain.parallel.diloco.streaming import StreamingOuter, fragment_cuts

__all__ = ["IslandGroups", "OUTER_COMPRESSIONS", "OUTER_OPTIMIZERS", "OuterStep", "StreamingOuter", "fragment_cuts",
           "island_labels", "island_ranks", "live_islands"]
