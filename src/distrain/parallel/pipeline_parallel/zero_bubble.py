"""Zero-bubble pipeline schedule ZB-H1: the op order and its bubble (pure planning).

Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv:2311.07679).
The backward of a micro-batch is split in two passes:

* B, the input gradient dL/dx (what the previous stage waits for), and
* W, the weight gradient dL/dW (what nobody waits for: only the optimizer step needs it),

so the W passes can be moved into the cool-down bubble that 1F1B leaves idle. How the
split is computed is :mod:`.weight_grad`; this module only orders the ops and states the
bubble. ZB-H1 is the paper's schedule with 1F1B's memory (section 3.1, figure 3 top).

Order on stage s of p, m >= p micro-batches (T = one op; B_k, W_k, F_k of micro-batch k)::

    F_0 .. F_{p-s-1}                        p - s warm-up forwards (1F1B's w + 1)
    then B_k, W_k, F_{p-s+k}                for k = 0 .. m-p-1 (steady state: B, W, F)
    then B_k and one filler op              for the p - 1 gaps k = m-p .. m-2 of the cool-down:
         the first s fillers are the s forwards left, the other p - 1 - s are the oldest W
    then B_{m-1} and the s + 1 W left       (W in micro-batch order throughout)

p = 4, m = 8 (one column = one op of time T; B and W of the same micro-batch share its number)::

    stage 0:  F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
    stage 1:  .  F0 F1 F2 .  .  B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 F7 B5 W4 B6 W5 B7 W6 W7
    stage 2:  .  .  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 F4 B3 W3 F5 B4 F6 B5 F7 B6 W4 B7 W5 W6 W7
    stage 3:  .  .  .  F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 F5 B5 F6 B6 F7 B7 W4 W5 W6 W7

Why it has no bubble past the fill (T_F = T_B = T_W = T): the B of micro-batch k runs on
stage s exactly one T after it ran on stage s + 1 (B_k at 2p-1-s+3k for k <= m-p, B_{m-p+j}
at 3m-p-1+2j-s in the cool-down), so no B waits once the first has run; stage s idles only its s
slots before F_0 and the p - 1 - s slots between its last warm-up forward and B_0, i.e.
p - 1 slots on every stage, and every stage ends at (3m + p - 1) T. Hence

    bubble = (p - 1) / (3m + p - 1)        (GPipe / 1F1B with T_B + T_W = 2T: (p - 1) / (m + p - 1))

the paper's (p - 1)(T_F + T_B - T_W) idle time per stage with T_F = T_B = T_W, against
1F1B's (p - 1)(T_F + T_B + T_W): a third. With m < p there is no steady state and the
B wave of micro-batch m-1 cannot start early enough; the step then takes (2m + 2p - 1) T,
i.e. ``makespan = 3m + p - 1 + max(0, p - m)`` in all cases (:func:`zb_h1_makespan`).

Memory: a micro-batch is in flight from its F until its W (W needs the layers' inputs and
output gradients). Stage 0 holds p, as in 1F1B; a later stage holds up to p in the cool-down
(it defers s + 1 W passes) where 1F1B's stage s holds p - s: the peak over the stages, the
pipeline's memory bound, is 1F1B's ``min(p, m)``. ``simulate("zb-h1", ...)`` in
:mod:`.schedule` plays these orders with their sends and receives; it completing proves the
executor cannot deadlock (W has no communication, so it never blocks).
"""

from __future__ import annotations

from distrain.comm.core.util import check_int
from distrain.errors import ConfigError

__all__ = ["zb_h1_bubble", "zb_h1_makespan", "zb_h1_ops"]


def _check(p: int, s: int, m: int) -> None:
    check_int(p, "num_stages", "zb-h1", 1)
    check_int(m, "num_microbatches", "zb-h1", 1)
    if not 0 <= s < p:
        raise ConfigError(f"stage {s} is out of range [0, {p})")


def zb_h1_ops(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s ops in order: ("F", k) forward, ("B", k) input gradient, ("W", k) weight gradient."""
    p, s, m = num_stages, stage, num_microbatches
    _check(p, s, m)
    warm = min(p - s, m)
    ops = [("F", k) for k in range(warm)]
    steady = max(m - p, 0)                 # gaps after B_0 .. B_{steady-1} hold a W and an F
    forwards_left = m - warm - steady      # s when m >= p: they fill the first cool-down gaps
    nf, nw = warm, 0
    for k in range(m):
        ops.append(("B", k))
        if k < steady:
            ops += [("W", nw), ("F", nf)]
            nw, nf = nw + 1, nf + 1
        elif k < m - 1 and forwards_left > 0:
            ops.append(("F", nf))
            nf, forwards_left = nf + 1, forwards_left - 1
        elif k < m - 1:
            ops.append(("W", nw))
            nw += 1
    return ops + [("W", k) for k in range(nw, m)]


def zb_h1_makespan(num_stages: int, num_microbatches: int) -> int:
    """Step time of ZB-H1 in units of one op (T_F = T_B = T_W), free communication: 3m + p - 1 + max(0, p - m)."""
    p, m = num_stages, num_microbatches
    return 3 * m + p - 1 + max(0, p - m)


def zb_h1_bubble(num_stages: int, num_microbatches: int) -> float:
    """Idle share of ZB-H1 with T_F = T_B = T_W: (p - 1) / (3m + p - 1) for m >= p (Qi et al. 2024, sec. 3.1);
    1 - 3m / (2m + 2p - 1) for m < p."""
    return 1.0 - 3 * num_microbatches / zb_h1_makespan(num_stages, num_microbatches)
