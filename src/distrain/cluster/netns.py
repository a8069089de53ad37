"""Network namespaces, veth pairs, one bridge and ``tc tbf``: an emulated cluster on one host.

Layout of a cluster called NAME with N nodes (every object lives inside a namespace that
the cluster created, so the host's own network, addresses and routes are never touched)::

    netns NAME-sw:  bridge br0, ports p0 .. p{N-1}      (the "switch")
    netns NAME-i:   lo, eth0 = 10.251.0.(i+1)/24        (node i; eth0 <-veth-> p{i})

Each link is shaped in both directions with the token bucket filter (``tc qdisc ... tbf
rate R``): on eth0 (node i's uplink) and on p{i} (its downlink, i.e. the switch port's
egress), so a node can neither send nor receive faster than its link, exactly as a host
behind a full-duplex switch port; each tbf queues ``--queue`` of traffic (tc's ``latency``, 50 ms
unless given) and drops the rest. Links carry jumbo frames (MTU 9000, ``--mtu`` changes it): every
node's packets are processed by this one host's cores, and at MTU 1500 that work is the bottleneck
long before the links are (docs/cluster.md has the measurement). Each node sets
``net.ipv4.tcp_slow_start_after_idle=0`` (its own namespace's sysctl).

Latency, jitter, loss and cuts (``--delay/--jitter/--loss``, ``cluster link --down``). The kernel
here has neither ``netem`` nor ``fq``, so:

* loss: on both shaped devices (eth0 and p{i}) the root becomes ``htb`` with two classes, 1:10
  (the tbf above, or a plain fifo when unshaped) and 1:20 (``pfifo limit 0``: drops every
  packet), and a classic-BPF filter (``tc filter ... bpf bytecode``: a random number, compared)
  sends a packet to 1:20 with probability q = 1 - sqrt(1 - P), so that a packet between two
  nodes of loss P, which crosses one node's uplink and the other's downlink, is lost with P;
* down: a second filter sends every packet (ARP included) of both directions to 1:20, until
  ``--up`` deletes it (the loss filter stays);
* delay and jitter, on a delayed node only: p{i} leaves the bridge, a second veth ``v{i}``-``b{i}``
  (both in the switch namespace) takes its place, ``b{i}`` a port of br0, and between ``p{i}`` and
  ``v{i}`` runs :mod:`distrain.cluster.wire`, a process that holds each frame delay/2 ± jitter/2
  per direction (so two nodes of delay D are D apart one way, 2D round trip)::

      node i (delayed):  eth0 <-veth-> p{i} <-wire.py-> v{i} <-veth-> b{i} (port of br0)

  Frames the line writes to p{i} still leave through p{i}'s qdisc, so the downlink keeps its
  rate, loss and cut. Setting the delay back to 0 ends the line, deletes v{i} and b{i} and puts
  p{i} back on the bridge.

Without delay and jitter a node's path is the plain one above (no extra device, no process, and
with neither loss nor a cut, tbf as the root qdisc, or no qdisc when unshaped), so a cluster
built without link settings is exactly the cluster that existed before they did.

A node's settings are read back from the kernel: the rate and queue from tbf, P from the filter's
threshold, down from the second filter, delay and jitter from the wire process's command line.

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
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from distrain.cluster.settings import (DEFAULT_QUEUE_US, format_loss, format_rate, format_time_us, parse_loss,
                                       parse_queue_us, parse_rate, parse_time_us, per_node)
from distrain.cluster.shaping import check_queue, rate_of, run as _sh, shape, shape_of
from distrain.errors import ClusterError, ConfigError

SUBNET = "10.251.0"  # private /24 that exists only inside the cluster's namespaces
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
WIRE = str(Path(__file__).with_name("wire.py"))  # the delay line, run as a script in the switch namespace
MTU_RANGE = (576, 65535)  # IPv4's minimum datagram; veth's largest MTU


@dataclass(frozen=True)
class ClusterSpec:
    """N nodes; ``links[i]`` is node i's link rate in bits/s (None: unshaped veth), ``delays_us[i]``
    and ``jitters_us[i]`` its one-way delay and jitter in µs (between two nodes of delay D: D one
    way, 2D round trip), ``losses[i]`` its loss in percent (of a packet between two nodes of loss
    P: P), ``down[i]`` whether it is cut off, ``queues_us[i]`` how much its tbf queues, in µs of traffic at
    its rate (both halves of its link; only with a rate). The last five default to none/up/50 ms."""

    name: str
    links: tuple[float | None, ...]
    mtu: int = 9000
    delays_us: tuple[int, ...] = field(default=())
    jitters_us: tuple[int, ...] = field(default=())
    losses: tuple[float, ...] = field(default=())
    down: tuple[bool, ...] = field(default=())
    queues_us: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.links)
        for attr, zero in (("delays_us", 0), ("jitters_us", 0), ("losses", 0.0), ("down", False),
                           ("queues_us", DEFAULT_QUEUE_US)):
            if not getattr(self, attr):
                object.__setattr__(self, attr, (zero,) * n)
            elif len(getattr(self, attr)) != n:
                raise ConfigError(f"ClusterSpec.{attr}: {len(getattr(self, attr))} values for {n} nodes")
        for i, (d, j) in enumerate(zip(self.delays_us, self.jitters_us)):
            if j > d:
                raise ConfigError(f"--jitter: {format_time_us(j)} is more than --delay {format_time_us(d)} "
                                  f"(node {i}); give a jitter at most the delay")
        for i, (bits, q) in enumerate(zip(self.links, self.queues_us)):
            check_queue(i, bits, self.mtu, q)

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
    def build(cls, name: str, nodes: int, link: str | None, mtu: int = 9000, delay: str | None = None,
              jitter: str | None = None, loss: str | None = None, queue: str | None = None) -> "ClusterSpec":
        """Validate the CLI's ``--name/--nodes/--link/--mtu/--delay/--jitter/--loss/--queue`` (each of the
        last five: one value for every node, or one per node, comma-separated)."""
        spec = cls._build_rates(name, nodes, link, mtu)
        return replace(spec, delays_us=per_node(delay, nodes, "--delay", lambda t: parse_time_us(t, "--delay"), 0),
                       jitters_us=per_node(jitter, nodes, "--jitter", lambda t: parse_time_us(t, "--jitter"), 0),
                       losses=per_node(loss, nodes, "--loss", parse_loss, 0.0),
                       queues_us=per_node(queue, nodes, "--queue", parse_queue_us, DEFAULT_QUEUE_US))

    @classmethod
    def _build_rates(cls, name: str, nodes: int, link: str | None, mtu: int) -> "ClusterSpec":
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


def _wire_pids(spec_name: str, i: int) -> list[int]:
    """The delay line(s) of node i (processes in the switch namespace running wire.py for p{i})."""
    found = []
    for pid in pids(f"{spec_name}-sw"):
        argv = _cmdline(pid)
        if WIRE in argv and argv[argv.index("--node-dev") + 1:][:1] == [f"p{i}"]:
            found.append(pid)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _wire_of(spec_name: str, i: int) -> tuple[int, int]:
    """(delay µs, jitter µs) of node i's link, from its delay line's command line ((0, 0): none)."""
    for pid in _wire_pids(spec_name, i):
        argv = _cmdline(pid)
        return int(argv[argv.index("--delay-us") + 1]), int(argv[argv.index("--jitter-us") + 1])
    return 0, 0


def _has_link(ns: str, dev: str) -> bool:
    return subprocess.run(["ip", "-n", ns, "link", "show", dev], capture_output=True).returncode == 0


def _set_wire(spec_name: str, i: int, mtu: int, delay_us: int, jitter_us: int) -> None:
    """Node i's path through the switch: p{i} a bridge port (no delay), or p{i} <-delay line-> v{i}
    <-veth-> b{i}, b{i} the bridge port. Decided from what exists, so it also repairs a half-made path."""
    sw = f"{spec_name}-sw"
    for pid in _wire_pids(spec_name, i):  # the old line goes first: two would carry every frame twice
        _stop(pid)
    ip = ("ip", "-n", sw, "link")
    if not delay_us and not jitter_us:  # the plain path: p{i} back on the bridge, the delay line's veth gone
        if _has_link(sw, f"v{i}"):
            _sh(*ip, "del", f"v{i}")  # b{i}, its peer, goes with it
        _sh(*ip, "set", f"p{i}", "master", "br0")  # nothing changes when it is a port already
        return
    # p{i} off the bridge before the line starts, so no frame ever has two ways across
    _sh(*ip, "set", f"p{i}", "nomaster")
    if not _has_link(sw, f"v{i}"):
        _sh(*ip, "add", f"v{i}", "mtu", str(mtu), "type", "veth", "peer", "name", f"b{i}", "mtu", str(mtu))
        _sh(*ip, "set", f"b{i}", "master", "br0")
        for dev in (f"b{i}", f"v{i}"):
            _sh(*ip, "set", dev, "up")
    proc = subprocess.Popen(["ip", "netns", "exec", sw, sys.executable, WIRE, "--node-dev", f"p{i}", "--switch-dev",
                             f"v{i}", "--delay-us", str(delay_us), "--jitter-us", str(jitter_us)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)  # its own session: it outlives `cluster up`
    line = proc.stdout.readline()  # "ready" once both sockets are bound; "" if it died
    proc.stdout.close()
    if line.strip() != "ready":
        err = proc.stderr.read().strip().splitlines()
        raise ClusterError(f"node {i}: the delay line did not start: {err[-1] if err else 'no output'}")
    proc.stderr.close()


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)


def _apply(spec: ClusterSpec, i: int, fresh: bool = False) -> None:
    """Node i's link as ``spec`` says: both halves' rate, loss and cut, and its path through the switch.
    ``fresh``: node i was just built (p{i} a bridge port, no qdisc), so an undelayed node needs no more."""
    bits, loss, down, queue = spec.links[i], spec.losses[i], spec.down[i], spec.queues_us[i]
    if not (fresh and bits is None and not loss and not down):
        shape(spec.netns(i), "eth0", bits, spec.mtu, loss, down, queue)  # uplink: node -> switch
        shape(spec.switch, f"p{i}", bits, spec.mtu, loss, down, queue)  # downlink: switch -> node
    if not (fresh and not spec.delays_us[i] and not spec.jitters_us[i]):
        _set_wire(spec.name, i, spec.mtu, spec.delays_us[i], spec.jitters_us[i])


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


def kill_all(name: str, grace: float = 2.0, switch: bool = True) -> int:
    """SIGTERM then SIGKILL every process inside the cluster's namespaces; returns how many there were.
    ``switch=False`` spares the switch namespace (its delay lines belong to the cluster, not to a run)."""
    victims = {p for ns in namespaces(name) if switch or not ns.endswith("-sw") for p in pids(ns)}
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
        for i in range(spec.nodes):
            ns = spec.netns(i)
            _sh("ip", "netns", "add", ns)
            mtu = ("mtu", str(spec.mtu))
            _sh("ip", "link", "add", "eth0", "netns", ns, *mtu, "type", "veth", "peer", "name", f"p{i}",
                "netns", spec.switch, *mtu)
            _sh(*sw, "link", "set", f"p{i}", "master", "br0")
            _sh(*sw, "link", "set", f"p{i}", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{spec.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # keep TCP's window across the idle gaps between collectives (a data-centre setting;
            # with the default, every call after a pause > RTO restarts from slow start)
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
            _apply(spec, i, fresh=True)
    except BaseException:
        down(spec.name)
        raise
    return spec


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
    shapes = [shape_of(f"{name}-{i}", "eth0") for i in nodes]
    wires = [_wire_of(name, i) for i in nodes]
    return ClusterSpec(name, tuple(r for r, _, _, _ in shapes), int(mtu.group(1)) if mtu else 1500,
                       delays_us=tuple(d for d, _ in wires), jitters_us=tuple(j for _, j in wires),
                       losses=tuple(loss for _, _, loss, _ in shapes), down=tuple(d for _, _, _, d in shapes),
                       queues_us=tuple(DEFAULT_QUEUE_US if q is None else q for _, q, _, _ in shapes))


def set_link(name: str, node: int, link: str | None = None, delay: str | None = None, jitter: str | None = None,
             loss: str | None = None, down: bool | None = None, queue: str | None = None) -> ClusterSpec:
    """Change node ``node``'s link on a running cluster (None: keep that setting); returns the cluster as
    it is then. Every value is checked before anything changes. A node made unshaped loses its queue
    with its tbf (shaped again: 50 ms unless ``queue`` says)."""
    spec = status(name)
    if spec is None:
        raise ClusterError(f"no cluster named {name!r}; create it with `distrain cluster up --name {name} --nodes N`")
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < spec.nodes:
        raise ConfigError(f"--node: cluster {name!r} has nodes 0..{spec.nodes - 1}, got {node!r}")

    def one(values: tuple, text: str | None, parse) -> tuple:
        return values if text is None else values[:node] + (parse(text),) + values[node + 1:]

    new = replace(spec,
                  links=one(spec.links, link, lambda t: None if t == "none" else parse_rate(t)),
                  delays_us=one(spec.delays_us, delay, lambda t: parse_time_us(t, "--delay")),
                  jitters_us=one(spec.jitters_us, jitter, lambda t: parse_time_us(t, "--jitter")),
                  losses=one(spec.losses, loss, parse_loss),
                  down=one(spec.down, None if down is None else "x", lambda _: bool(down)),
                  queues_us=one(spec.queues_us, "50ms" if link == "none" and queue is None else queue, parse_queue_us))
    _apply(new, node)
    return new


def describe(spec: ClusterSpec) -> str:
    rows = [f"cluster {spec.name}: {spec.nodes} node(s), switch netns {spec.switch}"]
    for i, bits in enumerate(spec.links):
        procs = len(pids(spec.netns(i)))
        rows.append(f"  node {i}: netns {spec.netns(i)}  eth0 {spec.address(i)}/24  link "
                    f"{format_rate(bits) if bits else 'unshaped'}  delay {format_time_us(spec.delays_us[i])}  "
                    f"jitter {format_time_us(spec.jitters_us[i])}  loss {format_loss(spec.losses[i])}  "
                    f"{'DOWN' if spec.down[i] else 'up'}  "
                    f"{'queue ' + format_time_us(spec.queues_us[i]) + '  ' if bits else ''}mtu {spec.mtu}  processes {procs}")
    return "\n".join(rows)
