"""``launch``: a script (or ``distrain train ...``) on every rank through torch's elastic launcher.

The launcher is the parent and runs the whole command once per rank (torchrun), so multi-node
rendezvous and restarts are torchrun's; here only the command line it is given is built: the
rendezvous (distrain.rendezvous), the entry point (``train ...`` runs this interpreter's CLI)
and the exit status.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Sequence

from distrain import lifeline, rendezvous, sealed
from distrain.errors import ConfigError


def _entrypoint(script_args: Sequence[str], world: int | None) -> list[str]:
    """torchrun's arguments for the command to run on every rank.

    ``train ...`` and ``distrain train ...`` (optionally after ``--``) run this interpreter's
    ``distrain`` CLI (so no PATH lookup picks another install); ``--nproc`` is added when
    missing so that the job's size is the launcher's. Anything else is a script.py and its args."""
    args = list(script_args)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise ConfigError("launch: give the script to run, e.g. `distrain launch --nproc-per-node 2 train.py` "
                          "or `distrain launch --nproc-per-node 2 train --steps 100`")
    if args[0] == "distrain" or os.path.basename(args[0]) == "distrain":
        args = args[1:]
        if not args:
            raise ConfigError("launch: `distrain` needs a subcommand, e.g. `-- distrain train --steps 100`")
    elif args[0] != "train":
        return args
    if args[0] == "train" and world is not None and not any(a == "--nproc" or a.startswith("--nproc=") for a in args):
        args += ["--nproc", str(world)]
    return ["-m", "distrain.cli", *args]


def _nproc_of(script_args: Sequence[str]) -> int | None:
    """The --nproc of a `train` command line, if given (to default --nproc-per-node)."""
    args = list(script_args)
    for i, a in enumerate(args):
        if a.startswith("--nproc="):
            return int(a.split("=", 1)[1])
        if a == "--nproc" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
    return None


def job_secret(several: bool) -> None:
    """Put the job's secret in ``DISTRAIN_JOB_SECRET`` for torchrun's rendezvous and the ranks (they
    inherit it): the user's (checked), or a new one for a job of one node. Nodes must share it, so a
    job of several nodes without one is refused before anything starts (distrain.sealed)."""
    if os.environ.get(sealed.ENV):
        sealed.check(os.environ[sealed.ENV])
    elif several:
        raise ConfigError(f"launch: a job over several nodes needs a shared secret, so that nobody else on the network "
                          f"can join or read its stores: set {sealed.ENV} to the same value on every node (make one "
                          f"with `distrain secret`)")
    else:
        os.environ[sealed.ENV] = sealed.new()


def launch(nproc_per_node: int | None, script_args: Sequence[str], nnodes: int | str = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, max_restarts: int = 0, rdzv_id: str = "distrain") -> int:
    """Run a script (or ``train ...``) on every rank through torch's elastic launcher (torchrun).

    One node without an endpoint uses torchrun's c10d rendezvous on a free port of 127.0.0.1
    (what --standalone does, but on the loopback: --standalone's stores listen on every
    interface); several nodes use it at ``rdzv_endpoint`` (HOST:PORT of any one node). Either
    way its stores listen on one address only (:func:`_rendezvous_handler`).
    The ranks die with this process whatever kills it (they watch its pid, see
    distrain.lifeline); under ``max_restarts`` a ``train`` job resumes from its newest
    checkpoint (DISTRAIN_RESUME=auto). Returns the exit status (0 when every rank succeeded).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    is_train = any(a in ("train", "distrain") or os.path.basename(a) == "distrain" for a in list(script_args)[:2])
    if nproc_per_node is None:
        nproc_per_node = _nproc_of(script_args) if is_train else None
        if nproc_per_node is None:
            raise ConfigError("launch: give --nproc-per-node N (ranks on this node)")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    world = nproc_per_node * int(nnodes) if str(nnodes).isdigit() else None
    argv = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    rendezvous.register()
    if rdzv_endpoint:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-backend={rendezvous.RDZV_BACKEND}",
                 f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
        local = rendezvous.address_toward(rdzv_endpoint)
        if local:  # the ranks' store (if this node hosts it) then listens where the endpoint's host is reached
            argv.append(f"--local-addr={local}")
    elif str(nnodes) != "1":
        raise ConfigError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (a host every node can reach)")
    else:  # the ranks find the workers' store at MASTER_ADDR = --local-addr
        argv += ["--nnodes=1", f"--rdzv-backend={rendezvous.RDZV_BACKEND}", "--rdzv-endpoint=127.0.0.1:0",
                 f"--rdzv-id={rdzv_id}", "--local-addr=127.0.0.1"]
        if "GLOO_SOCKET_IFNAME" not in os.environ and any(n == "lo" for _, n in socket.if_nameindex()):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one node: Gloo listens on the loopback only
    argv += _entrypoint(script_args, world)
    job_secret(several=str(nnodes) != "1")
    os.environ[lifeline.PARENT_ENV] = str(os.getpid())  # the ranks inherit it and watch us
    if max_restarts > 0:
        os.environ.setdefault("DISTRAIN_RESUME", "auto")
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.ERROR)  # their shutdown chatter: we print one line instead
    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # else a train flag such as --nproc is taken for torchrun's --nproc-per-node
    try:
        torchrun.run(parser.parse_args(argv))
    except SystemExit as e:
        return int(e.code or 0)
    except SignalException as e:  # torchrun turns SIGTERM/SIGINT/SIGHUP into this after stopping the ranks
        print(f"distrain launch: stopped by {e.sigval.name}; every rank was stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except Exception as e:  # torchrun raises ChildFailedError with every failed rank's traceback
        print(e)
        return 1
    return 0
