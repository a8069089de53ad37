"""Whether expert parallelism fits: ep against the experts and the data ranks it borrows (pure; imports
nothing but errors and tensor parallelism's ``divisors``). The trainer's config runs these before any
rank starts; ``ExpertParallel.local_ids`` and ``Topology`` repeat them where they act."""

from __future__ import annotations

from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.sizes import divisors

__all__ = ["check_ep_flags", "check_ep_layout", "check_ep_sizes"]


def check_ep_sizes(ep: int, num_experts: int | None, data_ranks: int, what: str = "the model") -> None:
    """One-line ConfigErrors: ``ep`` > 1 needs experts (``num_experts`` None: the model has none), ep
    divides them (every rank holds E/ep whole experts), and ep divides ``data_ranks`` = dp x cp (the
    ranks it borrows: an ep group is ep of the ranks that hold the same non-expert parameters)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"--ep must be an int >= 1, got {ep!r}")
    if ep == 1:
        return
    if num_experts is None:
        raise ConfigError(f"--ep {ep}: {what} has no experts to split (expert parallelism places a mixture of "
                          f"experts' experts on different ranks); use a mixture-of-experts model, e.g. --model "
                          f"llama-moe-tiny, or drop --ep")
    if num_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide {what}'s {num_experts} experts (every rank holds num_experts / "
                          f"ep whole experts); choose --ep among {', '.join(map(str, divisors(num_experts)))}")
    if data_ranks % ep:
        fit = [d for d in divisors(num_experts) if data_ranks % d == 0]
        raise ConfigError(f"--ep {ep} does not divide dp x cp = {data_ranks} (expert parallelism borrows its ranks "
                          f"from the data-parallel ones: each ep group is ep of the ranks that share the other "
                          f"parameters); choose --ep among {', '.join(map(str, fit))}, or more --nproc")


def check_ep_layout(ep: int, *, tp: int = 1, pp: int = 1, zero_stage: int = 0) -> None:
    """What expert parallelism composes with here: dp and cp (the ranks it borrows) and tp (every tp
    rank keeps the mixture whole, ``tp_replicated``; its ep group lies within its tp coordinate). Not
    pp (the aux loss's gradient is added once per forward, a pipeline's micro-batches would count it
    once each), not ZeRO (its flat
    shards would mix expert and non-expert parameters, reduced over different groups)."""
    if ep == 1:
        return
    for n, flag, why in ((pp, "--pp", "the load-balancing loss's gradient is added once per forward, not per "
                                      "micro-batch"),
                         (zero_stage, "--strategy zero", "ZeRO's flat shards would mix expert and other parameters, "
                                                         "whose gradients reduce over different groups")):
        if n > (0 if flag == "--strategy zero" else 1):
            shown = f"{flag}{n}" if flag == "--strategy zero" else f"{flag} {n}"
            raise ConfigError(f"--ep {ep} does not compose with {shown}: {why}; use --ep with --dp/--cp/--tp and "
                              f"--strategy ddp")


def check_ep_flags(cfg, moe: dict | None) -> None:
    """The trainer's flags (``cfg``: a TrainConfig) against a preset's mixture ``moe`` (None: no experts,
    or your own model, whose experts are checked once built), before any rank starts: a mixture does
    not compose with --pp, --accum-steps or --elastic here; --ep counts no ranks of its own (it
    borrows from --dp); then :func:`check_ep_sizes` and, with ZeRO, :func:`check_ep_layout`."""
    if moe is not None:
        for n, flag, why in ((cfg.pp, "--pp", "the load-balancing loss's gradient is added once per forward, not "
                                              "per micro-batch"),):
            if n > 1:
                raise ConfigError(f"{flag} {n}: {cfg.model} is a mixture of experts, which does not compose with "
                                  f"{flag} here ({why}); use --dp, --cp and --ep")
        if cfg.accum_steps > 1:
            raise ConfigError(f"--accum-steps {cfg.accum_steps}: {cfg.model}'s load-balancing loss adds its gradient "
                              f"once per forward, not per accumulated micro-batch; drop --accum-steps")
        if cfg.elastic:
            raise ConfigError(f"--elastic {cfg.elastic}: {cfg.model} is a mixture of experts, whose router counts "
                              f"over a fixed group of ranks; train it without --elastic")
    if cfg.ep > 1 and cfg.dp and cfg.dp * cfg.cp * cfg.tp * cfg.pp != cfg.nproc:
        raise ConfigError(f"--ep {cfg.ep} --dp {cfg.dp} --nproc {cfg.nproc}: expert parallelism borrows its ranks "
                          f"from dp x cp, it is no factor of --nproc of its own; --dp counts every data-parallel "
                          f"rank: use --dp {cfg.nproc // (cfg.cp * cfg.tp * cfg.pp)} (dp x cp / ep = "
                          f"{cfg.nproc // (cfg.tp * cfg.pp * cfg.ep)} replicas of every expert), or drop --dp")
    if cfg.ep > 1 and not cfg.custom_model:
        check_ep_sizes(cfg.ep, moe["num_experts"] if moe else None, cfg.dp_size * cfg.cp, cfg.model)
    if cfg.ep > 1 and cfg.strategy.startswith("zero"):
        check_ep_layout(cfg.ep, zero_stage=int(cfg.strategy[4:]))
