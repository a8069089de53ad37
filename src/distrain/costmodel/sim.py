"""A flow-level simulator of message schedules on shared links (the α-β model, made exact).

The plain α-β model prices one message of n bytes at ``α + n·β`` (Hockney, "The
communication challenge for MPP", Parallel Computing 1994). A collective is many messages,
some concurrent, some waiting on others; its time is not a closed form once messages share
a link (a star's root: P-1 messages on one downlink) or wait on a reduction. So the model
here replays the schedule itself:

* a :class:`Message` goes from rank ``src`` to rank ``dst`` (``nbytes``), becomes *ready*
  when every message in ``deps`` has arrived plus ``delay`` seconds of compute at the sender
  (e.g. γ·bytes to add a received piece before forwarding it);
* on a fabric with ``handshake`` set (Gloo's TCP transport), it leaves no earlier than the
  receiver's "receive ready" notice arrives, α(dst, src) after the call starts: Gloo's pair
  holds an unbound-buffer send until the peer's notice for a posted receive has come
  (gloo/transport/tcp/pair.cc, Pair::send and handleRemotePendingRecv). The schedules'
  receives are all posted when the call starts (distrain's star, ring and tree post each
  one before the sender can be ready), so only a call's first messages wait on a notice;
* it then waits α of its path (per-message latency and software overhead), and for the
  previous message on the same (src, dst) pair to finish: Gloo sends one pair's messages
  in order over one TCP connection, which is what makes a ring's pieces pipeline;
* its bytes cross the links of its path (``Fabric.path``: the sender node's uplink and the
  receiver node's downlink between nodes, the node's shared loopback within one; and, in an
  emulated cluster, the host that carries every node's packets) at a rate
  given by max-min fair sharing among all flows active at that moment (progressive
  filling; TCP flows sharing a bottleneck converge to about this share), the link's capacity
  being what it delivers to that many flows at once (``Fabric.bandwidth(link, flows, nbytes)``,
  nbytes the most any of their pairs' connections carries in the schedule: less than its rate
  where a calibration measured TCP incast, or a long flow's losses, on it);
* the collective ends when its last message arrives, plus ``tail`` seconds of compute.

Events are flow arrivals, readiness and completions; rates are recomputed at each.
Cost: per event O(F) to advance the flows plus the rates' O(L^2 + F) (:func:`_fair_rates`), for
E events, F active flows, L links: milliseconds for hundreds to a few thousand messages, seconds
for a ring over 32 ranks in 1 MiB pieces, which is why ``distrain plan`` takes rings in closed
form (:mod:`distrain.costmodel.collectives`; docs/cost_model.md, "Speed").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass
class Message:
    src: int
    dst: int
    nbytes: float
    deps: Sequence[int] = ()
    delay: float = 0.0


class Fabric(Protocol):
    handshake: bool  # a send waits for the receiver's "receive ready" notice (Gloo's TCP pair)

    def path(self, src: int, dst: int) -> tuple[tuple, ...]: ...
    def alpha(self, src: int, dst: int) -> float: ...
    # in all, while ``flows`` flows cross it whose connections carry ``nbytes`` in the call
    def bandwidth(self, link: tuple, flows: int = 1, nbytes: float | None = None) -> float: ...


@dataclass(eq=False)
class _Flow:
    mid: int
    left: float
    links: tuple
    length: float = 0.0  # bytes its pair's connection carries in the whole schedule (TCP's transfer)
    rate: float = 0.0


@dataclass
class SimResult:
    seconds: float
    finish: list[float]  # per message
    link_bytes: dict = field(default_factory=dict)  # bytes carried per link

    def busiest(self) -> tuple[tuple | None, float]:
        if not self.link_bytes:
            return None, 0.0
        link = max(self.link_bytes, key=self.link_bytes.get)
        return link, self.link_bytes[link]


def _fair_rates(flows: list[_Flow], fabric: Fabric) -> None:
    """Max-min fair rates by progressive filling (Bertsekas & Gallager, Data Networks, 6.5.2): the link
    with the smallest equal share fixes its flows' rates, which leave every link they cross; repeat.
    Each link keeps its count of unfixed flows, so a round costs O(links) and the whole O(links^2 + flows)."""
    cap: dict[tuple, float] = {}
    users: dict[tuple, list[_Flow]] = {}
    for f in flows:
        for link in f.links:
            users.setdefault(link, []).append(f)
    for link, fs in users.items():  # a link's capacity may depend on how many flows cross it (TCP incast)
        cap[link] = fabric.bandwidth(link, len(fs), max(f.length for f in fs))
        if not cap[link] > 0:
            raise ValueError(f"link {link}: bandwidth must be positive, got {cap[link]}")
    left = {link: len(fs) for link, fs in users.items()}
    fixed: set[int] = set()
    while len(fixed) < len(flows):
        best, share = None, float("inf")
        for link, n in left.items():
            if n and cap[link] / n < share:
                best, share = link, cap[link] / n
        if best is None:
            break
        for f in users[best]:
            if id(f) in fixed:
                continue
            f.rate = share
            fixed.add(id(f))
            for link in f.links:
                cap[link] = max(cap[link] - share, 0.0)
                left[link] -= 1


def simulate(messages: Sequence[Message], fabric: Fabric, tail: float = 0.0) -> SimResult:
    """Replay ``messages`` on ``fabric``; returns the time of the last arrival + ``tail``."""
    n = len(messages)
    finish = [float("nan")] * n
    waiting = [len(m.deps) for m in messages]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, m in enumerate(messages):
        for d in m.deps:
            if not 0 <= d < i:
                raise ValueError(f"message {i}: dependency {d} must be an earlier message")
            children[d].append(i)
    prev_on_pair: dict[tuple[int, int], int] = {}
    pair_prev = [-1] * n
    for i, m in enumerate(messages):
        pair_prev[i] = prev_on_pair.get((m.src, m.dst), -1)
        prev_on_pair[(m.src, m.dst)] = i
    pair_bytes: dict[tuple[int, int], float] = {}
    for m in messages:
        pair_bytes[(m.src, m.dst)] = pair_bytes.get((m.src, m.dst), 0.0) + m.nbytes
    dep_done = [0.0] * n  # latest arrival among deps
    starts: list[tuple[float, int]] = []  # heap of (earliest byte-flow start, message)
    link_bytes: dict = {}

    def start(m: Message, ready: float) -> float:
        """When m's bytes may start to flow: it is ready, the receiver's notice (posted at time 0) has
        reached the sender if the fabric has a handshake, and then α of its path has passed."""
        notice = fabric.alpha(m.dst, m.src) if fabric.handshake else 0.0
        return max(ready, notice) + fabric.alpha(m.src, m.dst)

    for i, m in enumerate(messages):
        if waiting[i] == 0:
            heapq.heappush(starts, (start(m, m.delay), i))
    active: list[_Flow] = []
    blocked: dict[int, list[tuple[float, int]]] = {}  # pair predecessor -> (start, message)
    now, done = 0.0, 0

    def arrive(i: int, t: float) -> None:
        nonlocal done
        finish[i] = t
        done += 1
        for c in children[i]:
            dep_done[c] = max(dep_done[c], t)
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(starts, (start(messages[c], dep_done[c] + messages[c].delay), c))
        for s, c in blocked.pop(i, []):
            heapq.heappush(starts, (max(s, t), c))

    while done < n:
        t_start = starts[0][0] if starts else float("inf")
        t_end = min((now + f.left / f.rate for f in active if f.rate > 0), default=float("inf"))
        if t_start == float("inf") and t_end == float("inf"):
            raise ValueError("schedule deadlocks: some message can never start")
        t = min(t_start, t_end)
        for f in active:
            f.left -= f.rate * (t - now)
        now = t
        finished = [f for f in active if f.left <= 1e-9 * max(1.0, messages[f.mid].nbytes)]
        active = [f for f in active if f not in finished]
        for f in finished:
            arrive(f.mid, now)
        while starts and starts[0][0] <= now:
            s, i = heapq.heappop(starts)
            p = pair_prev[i]
            if p >= 0 and finish[p] != finish[p]:  # NaN: the pair's previous message is still in flight
                blocked.setdefault(p, []).append((s, i))
                continue
            m = messages[i]
            links = fabric.path(m.src, m.dst)
            for link in links:
                if link[0] != "host":  # a shared capacity (Fabric.host), not a link: not counted as one
                    link_bytes[link] = link_bytes.get(link, 0.0) + m.nbytes
            if m.nbytes <= 0 or not links:
                arrive(i, now)
            else:
                active.append(_Flow(i, float(m.nbytes), links, pair_bytes[(m.src, m.dst)]))
        _fair_rates(active, fabric)
    return SimResult(max(finish, default=0.0) + tail, finish, link_bytes)
