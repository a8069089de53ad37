"""A link's settings as the cluster commands take them: rates, times, loss percentages, one value or one per node.

Parsing and formatting only (no ip or tc here: netns.py applies them). Each parser raises a one-line
ConfigError naming the flag and a valid example."""

from __future__ import annotations

import re

from distrain.errors import ConfigError

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|ms|us)$")
_TIME_UNIT_US = {"s": 1_000_000, "ms": 1000, "us": 1}
_LOSS_RE = re.compile(r"^(\d+(?:\.\d+)?)%?$")
MAX_DELAY_US = 10_000_000  # 10 s one way: beyond any real link
DEFAULT_QUEUE_US = 50_000  # a shaped half-link's tbf queue (tc's ``latency``) unless --queue says otherwise
QUEUE_STEP_US = 100  # the queue's resolution: what tc reads back is rounded to it
MAX_QUEUE_US = 2_000_000  # 2 s of traffic: tbf's limit is a u32 of bytes (3.4 s at 10gbit), and beyond any switch

def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's units: bit, kbit, mbit, gbit; powers of 1000)."""
    m = _RATE_RE.match(str(text).strip().lower())
    if not m:
        raise ConfigError(f"--link: bad rate {text!r}; use tc units such as 100mbit, 1gbit, 10gbit")
    bits = float(m.group(1)) * _RATE_UNIT[m.group(2)]
    if bits < 1e5:
        raise ConfigError(f"--link: rate {text!r} is below 100kbit; the cluster would not be usable")
    return bits


def parse_time_us(text: str, flag: str) -> int:
    """``"25ms"`` -> 25000 µs (units s, ms, us; ``0`` alone is allowed), at most 10 s."""
    t = str(text).strip().lower()
    if t == "0":
        return 0
    m = _TIME_RE.match(t)
    if not m:
        raise ConfigError(f"{flag}: bad time {text!r}; use a number with a unit such as 25ms, 500us, 0.1s, or 0")
    us = round(float(m.group(1)) * _TIME_UNIT_US[m.group(2)])
    if us > MAX_DELAY_US:
        raise ConfigError(f"{flag}: {text!r} is over 10s one way; give a smaller time such as 25ms")
    return us


def parse_queue_us(text: str) -> int:
    """``"500ms"`` -> 500000 µs: how much traffic a shaped half-link's tbf queues, in time at its rate
    (tc's ``latency``); more than 0, at most 2 s, in steps of 0.1 ms (tc reads it back to within a few
    µs: the kernel keeps the queue as bytes)."""
    m = _TIME_RE.match(str(text).strip().lower())
    if not m:
        raise ConfigError(f"--queue: bad time {text!r}; use a number with a unit such as 50ms, 500ms, 0.5s")
    us = round(float(m.group(1)) * _TIME_UNIT_US[m.group(2)])
    if not 0 < us <= MAX_QUEUE_US:
        raise ConfigError(f"--queue: {text!r} is not in (0, 2s]; give the queue as a time of traffic at the "
                          f"link's rate such as 50ms (the default) or 500ms")
    if us % QUEUE_STEP_US:
        raise ConfigError(f"--queue: {text!r} is not a whole number of 0.1 ms; give e.g. 50ms, 500ms or 2.5ms")
    return us


def format_time_us(us: int) -> str:
    if us % 1000 == 0:
        return f"{us // 1000}ms"
    return f"{us / 1000:g}ms" if us >= 1000 else f"{us}us"


def parse_loss(text: str) -> float:
    """``"1.5"`` or ``"1.5%"`` -> 1.5 (percent of packets lost, [0, 100], 4 decimals kept)."""
    m = _LOSS_RE.match(str(text).strip())
    if not m or float(m.group(1)) > 100:
        raise ConfigError(f"--loss: bad loss {text!r}; give a percentage in [0, 100] such as 1 or 0.5%")
    return round(float(m.group(1)), 4)


def format_loss(pct: float) -> str:
    return f"{pct:g}%"


def format_rate(bits: float) -> str:
    for unit in ("gbit", "mbit", "kbit"):
        if bits >= _RATE_UNIT[unit] and (bits / _RATE_UNIT[unit]).is_integer():
            return f"{int(bits / _RATE_UNIT[unit])}{unit}"
    return f"{int(bits)}bit"


def per_node(text: str | None, nodes: int, flag: str, parse, zero) -> tuple:
    """``"25ms"`` or ``"25ms,50ms,..."`` (one per node) -> a value per node (``zero`` when not given)."""
    if text in (None, ""):
        return (zero,) * nodes
    values = [parse(v) for v in str(text).split(",")]
    if len(values) == 1:
        values *= nodes
    if len(values) != nodes:
        raise ConfigError(f"{flag}: give one value for all nodes or exactly {nodes} (one per node), got {len(values)}")
    return tuple(values)
