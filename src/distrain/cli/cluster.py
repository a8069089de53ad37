"""``distrain cluster up|down|status|link|run``: the command line of the emulated cluster.

The cluster is :mod:`distrain.cluster.netns` (namespaces, veths, tc), a run across its nodes
:mod:`distrain.cluster.runner`; this module parses the flags and prints what they return.
"""

from __future__ import annotations

import argparse
import sys

from distrain.cluster import netns
from distrain.cluster import runner as cluster_run
from distrain.errors import ConfigError

DEFAULT_NAME = "dt"


def add_parser(sub) -> None:
    """``distrain cluster`` on the subparsers ``sub``."""
    p = sub.add_parser("cluster", help="an emulated cluster on this host (netns + veth + tc) and runs across it")
    add_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("An emulated cluster on this host: one network namespace per node, veth pairs to a bridge, "
                     "each link shaped with tc tbf (rate, queue), a drop filter (loss, down) and a delay line (delay, jitter). Needs root and iproute2. See docs/cluster.md.")
    sub = p.add_subparsers(dest="cluster_command", required=True)
    up = sub.add_parser("up", help="build the cluster (replacing one of the same name)")
    up.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    up.add_argument("--link", default="1gbit",
                    help="link rate of every node (e.g. 100mbit, 1gbit), or one per node comma-separated, "
                         "or 'none' for unshaped veths (default 1gbit)")
    up.add_argument("--mtu", type=int, default=9000,
                    help="bytes per frame on every link (default 9000, jumbo frames as in data-centre fabrics; "
                         "1500 is standard Ethernet, and costs this host's cores about 6x more packets)")
    _link_flags(up, "every node's", " (default 0)")
    up.set_defaults(func=_up)
    down = sub.add_parser("down", help="end its processes and delete its namespaces, links and bridge")
    down.set_defaults(func=_down)
    st = sub.add_parser("status", help="show the nodes, addresses, link rates and processes")
    st.set_defaults(func=_status)
    ln = sub.add_parser("link", help="change one node's link on a running cluster (rate, delay, jitter, loss, queue, down/up)")
    ln.add_argument("--node", type=int, required=True, help="the node whose link changes (0..N-1)")
    ln.add_argument("--link", default=None, help="its new rate (e.g. 100mbit, or none: unshaped)")
    _link_flags(ln, "its new", " (default: unchanged)", per_node=False)
    cut = ln.add_mutually_exclusive_group()
    cut.add_argument("--down", dest="cut", action="store_const", const=True, default=None,
                     help="cut the node off from every other node (every packet of its link dropped) until --up")
    cut.add_argument("--up", dest="cut", action="store_const", const=False, help="reconnect a node cut off by --down")
    ln.set_defaults(func=_link)
    r = sub.add_parser("run", help="run a command on every node through distrain launch (torchrun)")
    r.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (default 1)")
    r.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of the job (default 0)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is ended (default 3600)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- distrain train --nproc 4")
    r.set_defaults(func=_run)
    for q in (up, down, st, ln, r):
        q.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name, prefix of its namespaces (default {DEFAULT_NAME})")


def _link_flags(p: argparse.ArgumentParser, whose: str, default: str, per_node: bool = True) -> None:
    each = ", or one per node comma-separated" if per_node else ""
    p.add_argument("--delay", default=None, help=f"{whose} one-way delay (e.g. 25ms, 500us; between two nodes of "
                                                 f"delay D: D one way, 2D round trip){each}{default}")
    p.add_argument("--jitter", default=None, help=f"{whose} jitter, at most the delay (e.g. 5ms: one way D ± 5ms, "
                                                  f"uniform, never reordered){each}{default}")
    p.add_argument("--loss", default=None, help=f"{whose} packet loss in percent (e.g. 1 or 0.5%%: of the packets "
                                                f"between two nodes of loss P, P are lost){each}{default}")
    p.add_argument("--queue", default=None,
                   help=f"{whose} link queue, as a time of traffic at its rate (tbf's latency; e.g. 500ms: what "
                        f"more waits is dropped), on both halves of the link; only with a rate (--link), in "
                        f"(0, 2s]{each}{default.replace('0)', '50ms)')}")


def _up(args: argparse.Namespace) -> int:
    spec = netns.up(netns.ClusterSpec.build(args.name, args.nodes, args.link, args.mtu, delay=args.delay,
                                            jitter=args.jitter, loss=args.loss, queue=args.queue))
    print(netns.describe(spec))
    return 0


def _down(args: argparse.Namespace) -> int:
    n = netns.down(args.name)
    print(f"cluster {args.name}: removed {n} namespace(s)" if n else f"cluster {args.name}: nothing to remove")
    return 0


def _existing(name: str) -> netns.ClusterSpec:
    spec = netns.status(name)
    if spec is None:
        raise netns.ClusterError(f"no cluster named {name!r}; create it with `distrain cluster up --name {name} --nodes N`")
    return spec


def _status(args: argparse.Namespace) -> int:
    print(netns.describe(_existing(args.name)))
    return 0


def _link(args: argparse.Namespace) -> int:
    spec = netns.set_link(args.name, args.node, link=args.link, delay=args.delay, jitter=args.jitter, loss=args.loss,
                          down=args.cut, queue=args.queue)
    print(netns.describe(spec).splitlines()[1 + args.node].strip())
    return 0


def _run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ConfigError("cluster run: give the command after --, e.g. `distrain cluster run -- distrain train --nproc 4`")
    spec = _existing(args.name)
    res = cluster_run.run(spec, cmd, procs_per_node=args.procs_per_node, max_restarts=args.max_restarts,
                          timeout=args.timeout)
    bad = res.first_failure
    if bad is not None:
        others = ", ".join(f"node {e.node}: {e.describe()}" for e in res.exits if e.node != bad.node)
        print(f"distrain cluster run: node {bad.node} (netns {spec.netns(bad.node)}) failed first: {bad.describe()}"
              + (f"; then {others}" if others else ""), file=sys.stderr)
    return res.returncode
