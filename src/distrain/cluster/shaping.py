"""One half of an emulated link in tc: its rate (tbf), its loss and its cut (an htb with a dropping class
chosen by BPF filters), set and read back from the kernel; and running ip and tc.

netns.py builds the namespaces and calls :func:`shape` on each half of each link (a node's eth0 and its
switch port); ``cluster status`` reads the settings back with :func:`shape_of`, so what it shows is what
the kernel does."""

from __future__ import annotations

import json
import re
import subprocess

from distrain.cluster.settings import DEFAULT_QUEUE_US, QUEUE_STEP_US, format_rate, format_time_us
from distrain.errors import ClusterError, ConfigError

RAND = 4294963256  # classic BPF: ld [SKF_AD_OFF + SKF_ADRANDOM], a random u32 per packet


def run(*argv: str, check: bool = True) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def tc(ns: str, *argv: str, check: bool = True) -> str:
    return run("ip", "netns", "exec", ns, "tc", *argv, check=check)


def tbf_burst(bits: float, mtu: int) -> int:
    """burst = 1/4000 s of traffic (>= 8 KiB, and >= two frames, or tbf could never send a full frame)."""
    return max(8192, 2 * (mtu + 14), int(bits / 8 / 4000))


def tbf_args(bits: float, mtu: int, queue_us: int = DEFAULT_QUEUE_US) -> list[str]:
    """Token bucket at ``bits``/s: burst :func:`tbf_burst` so TCP reaches the rate, queue = ``queue_us``
    of traffic (tc's ``latency``: tc makes it the limit, rate x latency + burst bytes; more is dropped)."""
    return ["tbf", "rate", f"{int(bits)}bit", "burst", str(tbf_burst(bits, mtu)), "latency", f"{int(queue_us)}us"]


def check_queue(node: int, bits: float | None, mtu: int, queue_us: int) -> None:
    """Refuse (one line) a queue that node ``node``'s link cannot have: one set without a rate (no tbf), or
    one over tbf's limit (a u32 of bytes: rate x queue + burst)."""
    if bits is None and queue_us != DEFAULT_QUEUE_US:
        raise ConfigError(f"--queue: node {node} has no rate (--link none), so no tbf and no queue to size; "
                          f"give it a --link rate or leave --queue out")
    if bits is not None and int(bits / 8 * queue_us / 1e6) + tbf_burst(bits, mtu) >= 1 << 32:
        raise ConfigError(f"--queue: {format_time_us(queue_us)} at {format_rate(bits)} (node {node}) is over "
                          f"4 GiB, tbf's largest queue; give a shorter --queue")


def loss_threshold(pct: float) -> int:
    """The random u32 below which one crossing drops a packet: q = 1 - sqrt(1 - P) per crossing (a
    packet between two nodes crosses two halves of links), as a fraction of 2^32."""
    q = 1.0 - (1.0 - pct / 100.0) ** 0.5
    return min(1 << 32, round(q * (1 << 32)))


def loss_of_threshold(t: int) -> float:
    return round(100.0 * (1.0 - (1.0 - t / (1 << 32)) ** 2), 4)


_DOWN_PRIO, _LOSS_PRIO = "1", "2"


def shape(ns: str, dev: str, bits: float | None, mtu: int, loss: float, down: bool,
          queue_us: int = DEFAULT_QUEUE_US) -> None:
    """The egress of one half of a link: rate ``bits`` with a queue of ``queue_us`` (tbf), then, with loss
    or down, a drop class."""
    if not loss and not down:  # the plain link: tbf alone (replaced in place), or the device's default
        if bits is not None:
            tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bits, mtu, queue_us))
        else:
            tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        return
    tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    # the classes only sort (the rate is tbf's, under 1:10); quantum set: htb's own default warns at this rate
    tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    for cls in ("1:10", "1:20"):
        tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", "100gbit", "quantum", "200000")
    tc(ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:",
        *(tbf_args(bits, mtu, queue_us) if bits is not None else ["pfifo", "limit", "1000"]))
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


_TIME_US = {"s": 1_000_000, "ms": 1000, "us": 1}


def queue_of(text_out: str, json_out: str) -> int | None:
    """The tbf's queue in µs (tc's ``lat``), rounded to the 0.1 ms that ``--queue`` is given in; None
    without a tbf. From ``tc -j``'s ``lat`` (µs, within a few µs of what was set: the kernel keeps a
    byte limit), else from the text's ``lat 500ms`` / ``lat 1.25s`` (three significant digits)."""
    us = None
    try:
        for q in json.loads(json_out or "[]"):
            if q.get("kind") == "tbf" and "lat" in q.get("options", {}):
                us = float(q["options"]["lat"])
    except (ValueError, AttributeError, TypeError):
        us = None
    if us is None:
        m = re.search(r"tbf .*?\blat (\d+(?:\.\d+)?)(s|ms|us)\b", text_out)
        if not m:
            return None
        us = float(m.group(1)) * _TIME_US[m.group(2)]
    return max(QUEUE_STEP_US, round(us / QUEUE_STEP_US) * QUEUE_STEP_US)


def shape_of(ns: str, dev: str) -> tuple[float | None, int | None, float, bool]:
    """(rate, queue µs, loss %, down) of one half of a link, read back from tc (rate and queue None
    without a tbf)."""
    out = tc(ns, "qdisc", "show", "dev", dev, check=False)
    m = re.search(r"tbf .*?rate (\d+(?:\.\d+)?)([KMG]?)bit", out)
    rate = float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)] if m else None
    queue = queue_of(out, tc(ns, "-j", "qdisc", "show", "dev", dev, check=False)) if m else None
    loss, down = 0.0, False
    if "htb" in out:
        filters = tc(ns, "filter", "show", "dev", dev, check=False)
        for pref, code in re.findall(r"pref (\d+) bpf .*?bytecode '([^']*)'", filters):
            if pref == _DOWN_PRIO:
                down = True
            elif pref == _LOSS_PRIO:
                m = re.match(r"4,32 0 0 \d+,53 0 1 (\d+),", code)
                loss = loss_of_threshold(int(m.group(1))) if m else 100.0
    return rate, queue, loss, down


def queue_of_dev(ns: str, dev: str) -> int | None:
    return shape_of(ns, dev)[1]


def rate_of(ns: str, dev: str) -> float | None:
    return shape_of(ns, dev)[0]
