"""Which sizes a :class:`~distrain.topology.Topology` accepts, and what it suggests instead.

The rules, each refused with one ConfigError line: every size (dp, tp, pp, cp, ep, islands) an
int >= 1 and the rank an int; the world size an int >= 1 equal to islands * dp * cp * tp * pp
(the message suggests sizes whose product it is, keeping the user's tp, pp and cp where they
fit); the rank inside the world; ep dividing dp * cp (expert parallelism borrows its ranks from
the data-parallel ones; the message lists the divisors).

Pure: reads the sizes off the topology being built, starts nothing.
"""

from __future__ import annotations

from distrain.errors import ConfigError


def checked_world_size(topo) -> int:
    """The world size of ``topo`` (as given, or the product of its sizes when it gives none) once
    every rule above holds; else the ConfigError of the first that does not."""
    for name in ("dp", "tp", "pp", "cp", "ep", "islands", "rank"):
        v = getattr(topo, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
        if name != "rank" and v < 1:
            raise ConfigError(f"{name} must be >= 1, got {name}={v}")
    product = topo.dp * topo.tp * topo.pp * topo.cp * topo.islands
    ws = product if topo.world_size is None else topo.world_size
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {ws!r}")
    if product != ws:
        names, sizes = ("dp*cp*tp*pp", (topo.dp, topo.cp, topo.tp, topo.pp)) if topo.cp > 1 else \
            ("dp*tp*pp", (topo.dp, topo.tp, topo.pp))
        hint = suggest(ws, topo.dp, topo.tp, topo.pp, topo.cp)
        if topo.islands > 1:
            names, sizes = f"islands*{names}", (topo.islands,) + sizes
            k = topo.islands
            hint = f"islands={k} of " + suggest(ws // k, topo.dp, topo.tp, topo.pp, topo.cp) if ws % k == 0 \
                else f"islands among the divisors of {ws}"
        raise ConfigError(
            f"{names} = {'*'.join(map(str, sizes))} = {product} does not equal the "
            f"world size {ws}; choose sizes whose product is {ws} "
            f"(e.g. {hint})"
        )
    if not 0 <= topo.rank < ws:
        raise ConfigError(f"rank {topo.rank} is out of range [0, {ws}) for world size {ws}")
    if (topo.dp * topo.cp) % topo.ep:
        fit = [d for d in range(1, topo.dp * topo.cp + 1) if (topo.dp * topo.cp) % d == 0]
        raise ConfigError(f"ep={topo.ep} does not divide dp*cp = {topo.dp * topo.cp}: expert parallelism borrows "
                          f"its ranks from the data-parallel ones; choose ep among {', '.join(map(str, fit))}")
    return ws


def suggest(world_size: int, dp: int, tp: int, pp: int, cp: int = 1) -> str:
    """Suggest sizes whose product is world_size, keeping the user's tp/pp/cp where possible."""
    options = [f"dp={world_size}"]
    mp = tp * pp * cp
    if mp > 1 and world_size % mp == 0 and world_size != mp:
        kept = (f"dp={world_size // mp}" + (f", cp={cp}" if cp > 1 else "") + f", tp={tp}"
                + (f", pp={pp}" if pp > 1 else ""))
        options.append(kept)
    else:  # split off the smallest prime factor as tp
        f = next((k for k in range(2, world_size) if world_size % k == 0), None)
        if f is not None:
            options.append(f"dp={world_size // f}, tp={f}")
    return " or ".join(options)
