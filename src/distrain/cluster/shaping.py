"""One half of an emulated link in tc: its rate (tbf), its loss and its cut (an htb with a dropping class
chosen by BPF filters), set and read back from the kernel; and running ip and tc.

netns.py builds the namespaces and calls :func:`shape` on each half of each link (a node's eth0 and its
switch port); ``cluster status`` reads the settings back with :func:`shape_of`, so what it shows is what
the kernel does."""

from __future__ import annotations

import re
import subprocess

from distrain.errors import ClusterError

RAND = 4294963256  # classic BPF: ld [SKF_AD_OFF + SKF_ADRANDOM], a random u32 per packet


def run(*argv: str, check: bool = True) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def tc(ns: str, *argv: str, check: bool = True) -> str:
    return run("ip", "netns", "exec", ns, "tc", *argv, check=check)


def tbf_args(bits: float, mtu: int) -> list[str]:
    """Token bucket at ``bits``/s: burst = 1/4000 s of traffic (>= 8 KiB, and >= two frames, or
    tbf could never send a full frame) so TCP reaches the rate, queue = 50 ms of traffic (tc's
    ``latency``)."""
    burst = max(8192, 2 * (mtu + 14), int(bits / 8 / 4000))
    return ["tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "50ms"]


def loss_threshold(pct: float) -> int:
    """The random u32 below which one crossing drops a packet: q = 1 - sqrt(1 - P) per crossing (a
    packet between two nodes crosses two halves of links), as a fraction of 2^32."""
    q = 1.0 - (1.0 - pct / 100.0) ** 0.5
    return min(1 << 32, round(q * (1 << 32)))


def loss_of_threshold(t: int) -> float:
    return round(100.0 * (1.0 - (1.0 - t / (1 << 32)) ** 2), 4)


_DOWN_PRIO, _LOSS_PRIO = "1", "2"


def shape(ns: str, dev: str, bits: float | None, mtu: int, loss: float, down: bool) -> None:
    """The egress of one half of a link: rate ``bits`` (tbf), then, with loss or down, a drop class."""
    if not loss and not down:  # the plain link: tbf alone (replaced in place), or the device's default
        if bits is not None:
            tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bits, mtu))
        else:
            tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        return
    tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    # the classes only sort (the rate is tbf's, under 1:10); quantum set: htb's own default warns at this rate
    tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    for cls in ("1:10", "1:20"):
        tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", "100gbit", "quantum", "200000")
    tc(ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:",
        *(tbf_args(bits, mtu) if bits is not None else ["pfifo", "limit", "1000"]))
    tc(ns, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")  # drops all
    if down:  # every packet: return -1 (the filter's flowid)
        tc(ns, "filter", "add", "dev", dev, "parent", "1:", "prio", _DOWN_PRIO, "bpf", "bytecode",
            "1,6 0 0 4294967295", "flowid", "1:20")
    if loss:
        t = loss_threshold(loss)
        # A = random; if A >= t: return 0 (no match: default 1:10) else return -1 (1:20)
        prog = f"4,32 0 0 {RAND},53 0 1 {t},6 0 0 0,6 0 0 4294967295" if t < (1 << 32) else "1,6 0 0 4294967295"
        tc(ns, "filter", "add", "dev", dev, "parent", "1:", "prio", _LOSS_PRIO, "bpf", "bytecode", prog,
            "flowid", "1:20")


def shape_of(ns: str, dev: str) -> tuple[float | None, float, bool]:
    """(rate, loss %, down) of one half of a link, read back from tc."""
    out = tc(ns, "qdisc", "show", "dev", dev, check=False)
    m = re.search(r"tbf .*?rate (\d+(?:\.\d+)?)([KMG]?)bit", out)
    rate = float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)] if m else None
    loss, down = 0.0, False
    if "htb" in out:
        filters = tc(ns, "filter", "show", "dev", dev, check=False)
        for pref, code in re.findall(r"pref (\d+) bpf .*?bytecode '([^']*)'", filters):
            if pref == _DOWN_PRIO:
                down = True
            elif pref == _LOSS_PRIO:
                m = re.match(r"4,32 0 0 \d+,53 0 1 (\d+),", code)
                loss = loss_of_threshold(int(m.group(1))) if m else 100.0
    return rate, loss, down


def rate_of(ns: str, dev: str) -> float | None:
    return shape_of(ns, dev)[0]
