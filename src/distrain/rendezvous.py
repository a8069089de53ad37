"""torchrun's c10d rendezvous with its stores bound to one address and its state authenticated: the
``distrain-c10d`` backend; and :func:`listening_store`, a TCPStore server on one address.

``distrain launch`` registers it (:func:`register`) and names it with ``--rdzv-backend``, so a
one-node job listens on 127.0.0.1 only and a multi-node job only on the endpoint's address
(torch's own c10d backend binds every interface; see ``_rendezvous_handler``). torch's rendezvous
keeps its state in the store as a *pickle*, which its handler unpickles: a stranger who can reach the
port could make every launcher run code. Here the state carries an HMAC under the job's secret
(distrain.sealed; the launcher puts it in ``DISTRAIN_JOB_SECRET`` before torchrun starts), and a state
whose tag does not match is refused before torch unpickles it.
"""

from __future__ import annotations

import hmac
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from distrain import sealed

RDZV_BACKEND = "distrain-c10d"  # torchrun's c10d rendezvous, its stores on one address (below)


def _listener(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host``'s address only (IPv4 first), or None when ``host`` is no
    address of this machine or the port is taken there (another process hosts it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, addr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    return None


def listening_store(host: str, port: int, timeout: timedelta, world: int | None = None,
                    multi_tenant: bool = False) -> dist.TCPStore | None:
    """A TCPStore server listening on ``host``'s address only, or None where :func:`_listener`
    finds none (``host`` is no address of this machine, or the port is taken). TCPStore binds
    every interface when it opens the port itself (``*:PORT``); handed a socket already bound
    and listening (``master_listen_fd``), it serves that one. ``port`` 0: one the OS picks."""
    sock = _listener(host, port)
    if sock is None:
        return None
    return dist.TCPStore(host, sock.getsockname()[1], world, is_master=True, multi_tenant=multi_tenant,
                         timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def address_toward(endpoint: str) -> str | None:
    """This machine's address on the route to the rendezvous endpoint's host (the host's own
    address on that machine), or None if it cannot be found (torchrun then uses the node's
    fully qualified name)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)  # UDP: picks the route and source address, sends nothing
            return probe.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return None


def tagged_backend(store: dist.Store, run_id: str, secret: bytes):
    """torch's c10d rendezvous backend over ``store``, its state (a pickle, which torch's handler
    unpickles) carrying an HMAC under the job's secret: a state whose tag does not match is refused
    with RendezvousStateError before anything reads it."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    class Backend(c10d.C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler's backend has the name asked for
            return RDZV_BACKEND

        def set_state(self, state: bytes, token=None):
            got = super().set_state(sealed.tag(secret, state, "rdzv") + state, token)
            return None if got is None else (got[0], got[1], got[0] == state)

        def _decode_state(self, base64_state: bytes):
            got = super()._decode_state(base64_state)
            if got is None:
                return None
            state, token = got
            if len(state) < 32 or not hmac.compare_digest(state[:32], sealed.tag(secret, state[32:], "rdzv")):
                raise RendezvousStateError(
                    "distrain launch: the rendezvous state in the store is not tagged with this job's secret (written "
                    "by a process outside the job, or a node started with another DISTRAIN_JOB_SECRET); refused "
                    "unread")
            return state[32:], token

    return Backend(store, run_id)


def _rendezvous_handler(params):
    """torchrun's c10d rendezvous handler (the same protocol and store keys) with its two
    TCPStores listening on one address instead of every interface. torch 2.13 has no option
    for that: c10d_rendezvous_backend._create_tcp_store (rendezvous options: is_host,
    read_timeout) and DynamicRendezvousHandler._create_tcp_store_server both construct
    ``TCPStore(host, port, is_master=True)``, which binds ``*:port``; --standalone is the
    same with the endpoint localhost:0. A registered backend (torch's extension point) is
    how torchrun takes another handler.

    * the rendezvous store, at the endpoint HOST:PORT: the launcher on the machine that has
      HOST's address hosts it on that address (127.0.0.1 for one node); any other node, or a
      second launcher on that machine (port taken), connects to it;
    * the workers' store (MASTER_ADDR:MASTER_PORT, hosted by the launcher of group rank 0)
      listens on the address it advertises, torchrun's ``--local-addr`` (127.0.0.1 for one
      node; else this machine's address toward the endpoint, :func:`address_toward`: on the
      endpoint's machine, the endpoint's address). Should that be no address of this machine,
      it falls back to torch's every-interface store, saying so.
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    secret = sealed.check(os.environ.get(sealed.ENV, ""))  # (launch() puts it there before torchrun starts)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=c10d.DEFAULT_PORT)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = listening_store(host, port, timeout, multi_tenant=True) or \
        dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    handler = create_handler(store, tagged_backend(store, params.run_id, secret), params)

    def workers_store(master_addr: str, master_port: int) -> dist.TCPStore:
        server = listening_store(master_addr, master_port, timedelta(seconds=300), multi_tenant=True)
        if server is None:
            print(f"distrain launch: {master_addr} (this node's address for the ranks) is no address of this machine; "
                  f"the ranks' store listens on every interface", file=sys.stderr)
            server = dist.TCPStore(master_addr, master_port, is_master=True, multi_tenant=True)
        return server

    handler._create_tcp_store_server = workers_store  # torch's hook for that store (dynamic_rendezvous.py)
    return handler


def register() -> None:
    """Make ``--rdzv-backend distrain-c10d`` known to torchrun (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RDZV_BACKEND, _rendezvous_handler)  # idempotent for the same creator
