"""Network namespaces, veth pairs, one bridge and ``tc tbf``: an emulated cluster on one host.

Layout of a cluster called NAME with N nodes (every object lives inside a namespace that
the cluster created, so the host's own network, addresses and routes are never touched)::

    netns NAME-sw:  bridge br0, ports p0 .. p{N-1}      (the "switch")
    netns NAME-i:   lo, eth0 = 10.251.0.(i+1)/24        (node i; eth0 <-veth-> p{i})

Each link is shaped in both directions with the token bucket filter (``tc qdisc ... tbf
rate R``): on eth0 (node i's uplink) and on p{i} (its downlink, i.e. the switch port's
egress), so a node can neither send nor receive faster than its link, exactly as a host
behind a full-duplex switch port. Links carry jumbo frames (MTU 9000, as data-centre and HPC
fabrics do; ``--mtu`` changes it): every node's packets are processed by this one host's
cores, and at MTU 1500 that work is the bottleneck long before the links are. Measured with
eight nodes on 200 Mbit/s links, all sending at once (docs/cost_model.md): MTU 1500 kept the
2 cores 84-91 % busy (softirq 59-74 %) and moved 96-140 MB/s in all; MTU 9000 moved 159-167
MB/s with the cores 37-49 % busy. The kernel here has no netem, so no latency is added:
the per-message latency is whatever the stack gives (``distrain bench link`` measures it).
Each node sets ``net.ipv4.tcp_slow_start_after_idle=0`` (its own namespace's sysctl).

Nothing is kept in files: the cluster *is* its namespaces, so ``status`` reads it back
from ``ip netns`` and ``tc``; ``down`` ends every process inside the namespaces
(``ip netns pids``) and deletes them, which removes the veths and the bridge with them.
``up`` first removes any leftovers of a cluster with the same name (after a crash).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from distrain.errors import ConfigError, DistrainError

SUBNET = "10.251.0"  # private /24 that exists only inside the cluster's namespaces
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
MTU_RANGE = (576, 65535)  # IPv4's minimum datagram; veth's largest MTU


class ClusterError(DistrainError):
    """The emulated cluster could not be built, found or used."""


def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's units: bit, kbit, mbit, gbit; powers of 1000)."""
    m = _RATE_RE.match(str(text).strip().lower())
    if not m:
        raise ConfigError(f"--link: bad rate {text!r}; use tc units such as 100mbit, 1gbit, 10gbit")
    bits = float(m.group(1)) * _RATE_UNIT[m.group(2)]
    if bits < 1e5:
        raise ConfigError(f"--link: rate {text!r} is below 100kbit; the cluster would not be usable")
    return bits


def format_rate(bits: float) -> str:
    for unit in ("gbit", "mbit", "kbit"):
        if bits >= _RATE_UNIT[unit] and (bits / _RATE_UNIT[unit]).is_integer():
            return f"{int(bits / _RATE_UNIT[unit])}{unit}"
    return f"{int(bits)}bit"


@dataclass(frozen=True)
class ClusterSpec:
    """N nodes; ``links[i]`` is node i's link rate in bits/s (None: unshaped veth)."""

    name: str
    links: tuple[float | None, ...]
    mtu: int = 9000

    @property
    def nodes(self) -> int:
        return len(self.links)

    def netns(self, i: int) -> str:
        return f"{self.name}-{i}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @classmethod
    def build(cls, name: str, nodes: int, link: str | None, mtu: int = 9000) -> "ClusterSpec":
        """Validate the CLI's ``--name/--nodes/--link/--mtu`` (``1gbit`` or one rate per node, comma-separated)."""
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not MTU_RANGE[0] <= mtu <= MTU_RANGE[1]:
            raise ConfigError(f"--mtu: must be an integer in [{MTU_RANGE[0]}, {MTU_RANGE[1]}] bytes (1500: standard "
                              f"Ethernet, 9000: jumbo frames), got {mtu!r}")
        if not _NAME_RE.match(name):
            raise ConfigError(f"--name: {name!r} must be 1-12 lowercase letters/digits starting with a letter")
        if not isinstance(nodes, int) or not 1 <= nodes <= 64:
            raise ConfigError(f"--nodes: must be an integer in [1, 64], got {nodes!r}")
        if link in (None, "", "none"):
            return cls(name, (None,) * nodes, mtu)
        rates = [parse_rate(r) for r in str(link).split(",")]
        if len(rates) == 1:
            rates *= nodes
        if len(rates) != nodes:
            raise ConfigError(f"--link: give one rate for all nodes or exactly {nodes} (one per node), "
                              f"got {len(rates)}")
        return cls(name, tuple(rates), mtu)


# ---------------------------------------------------------------------------------------
# Running ip/tc
# ---------------------------------------------------------------------------------------

def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here (None when it can): root and iproute2."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the emulated cluster needs iproute2 (the `ip` and `tc` commands); install it (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth pairs and tc); run as root"
    probe = f"dtprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed here ({r.stderr.strip()}); network namespaces are not available"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require() -> None:
    reason = unavailable_reason()
    if reason:
        raise ClusterError(reason)


def _sh(*argv: str, check: bool = True) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def _tbf(ns: str, dev: str, bits: float, mtu: int) -> None:
    """Token bucket at ``bits``/s: burst = 1/4000 s of traffic (>= 8 KiB, and >= two frames, or
    tbf could never send a full frame) so TCP reaches the rate, queue = 50 ms of traffic (tc's
    ``latency``)."""
    burst = max(8192, 2 * (mtu + 14), int(bits / 8 / 4000))
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "50ms")


# ---------------------------------------------------------------------------------------
# up / down / status
# ---------------------------------------------------------------------------------------

def namespaces(name: str) -> list[str]:
    """This cluster's namespaces that exist now (nodes and switch)."""
    out = _sh("ip", "netns", "list", check=False)
    found = [line.split()[0] for line in out.splitlines() if line.strip()]
    pat = re.compile(rf"^{re.escape(name)}-(sw|\d+)$")
    return [n for n in found if pat.match(n)]


def pids(ns: str) -> list[int]:
    out = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_all(name: str, grace: float = 2.0) -> int:
    """SIGTERM then SIGKILL every process inside the cluster's namespaces; returns how many there were."""
    victims = {p for ns in namespaces(name) for p in pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in victims:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in victims):
            time.sleep(0.05)
    return len(victims)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def down(name: str) -> int:
    """End every process in the cluster and delete its namespaces; returns how many namespaces went."""
    require()
    kill_all(name)
    gone = namespaces(name)
    for ns in gone:
        _sh("ip", "netns", "del", ns, check=False)
    left = namespaces(name)
    if left:
        raise ClusterError(f"cluster {name!r}: could not delete namespace(s) {left}")
    return len(gone)


def up(spec: ClusterSpec) -> ClusterSpec:
    """Build the cluster (removing leftovers of one with the same name first)."""
    require()
    down(spec.name)
    try:
        _sh("ip", "netns", "add", spec.switch)
        sw = ("ip", "-n", spec.switch)
        _sh(*sw, "link", "add", "br0", "type", "bridge")
        _sh(*sw, "link", "set", "br0", "up")
        for i, bits in enumerate(spec.links):
            ns = spec.netns(i)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", "eth0", "netns", ns, "mtu", str(spec.mtu), "type", "veth", "peer", "name", f"p{i}",
                "netns", spec.switch, "mtu", str(spec.mtu))
            _sh(*sw, "link", "set", f"p{i}", "master", "br0")
            _sh(*sw, "link", "set", f"p{i}", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{spec.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # keep TCP's window across the idle gaps between collectives (a data-centre setting;
            # with the default, every call after a pause > RTO restarts from slow start)
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
            if bits is not None:
                _tbf(ns, "eth0", bits, spec.mtu)  # uplink: node -> switch
                _tbf(spec.switch, f"p{i}", bits, spec.mtu)  # downlink: switch -> node
    except BaseException:
        down(spec.name)
        raise
    return spec


def _rate_of(ns: str, dev: str) -> float | None:
    out = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev, check=False)
    m = re.search(r"tbf .*?rate (\d+(?:\.\d+)?)([KMG]?)bit", out)
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)]


def status(name: str) -> ClusterSpec | None:
    """Read the cluster back from the kernel (None when it does not exist)."""
    require()
    found = namespaces(name)
    nodes = sorted(int(n.rsplit("-", 1)[1]) for n in found if not n.endswith("-sw"))
    if not nodes:
        return None
    if nodes != list(range(len(nodes))) or f"{name}-sw" not in found:
        raise ClusterError(f"cluster {name!r} is incomplete ({sorted(found)}); run `distrain cluster down --name {name}`")
    mtu = re.search(r" mtu (\d+)", _sh("ip", "-n", f"{name}-0", "link", "show", "eth0", check=False))
    return ClusterSpec(name, tuple(_rate_of(f"{name}-{i}", "eth0") for i in nodes), int(mtu.group(1)) if mtu else 1500)


def describe(spec: ClusterSpec) -> str:
    rows = [f"cluster {spec.name}: {spec.nodes} node(s), switch netns {spec.switch}"]
    for i, bits in enumerate(spec.links):
        procs = len(pids(spec.netns(i)))
        rows.append(f"  node {i}: netns {spec.netns(i)}  eth0 {spec.address(i)}/24  link "
                    f"{format_rate(bits) if bits else 'unshaped'}  mtu {spec.mtu}  processes {procs}")
    return "\n".join(rows)
