"""Which host a rank is on, and whether this host can use the shared-memory transport."""

from __future__ import annotations

import os
import platform
import socket

from distrain.comm.shm import segment as seg_mod

_host_override: str | None = None


def set_host_id(host: str | None) -> None:
    """Pretend this process runs on host ``host`` (tests make one machine look like several)."""
    global _host_override
    _host_override = host


def host_id() -> str:
    """This machine's identity: the hostname and the kernel's boot id (or the test override)."""
    if _host_override is not None:
        return _host_override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def unsupported() -> str | None:
    """None when this host can use the transport, else why not (in words for an error)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs x86-64 (its ordering of memory accesses), this machine is {platform.machine()}"
    if not os.path.isdir(seg_mod.SHM_DIR):
        return f"{seg_mod.SHM_DIR} does not exist"
    if not os.access(seg_mod.SHM_DIR, os.W_OK):
        return f"{seg_mod.SHM_DIR} is not writable by this user"
    return None


def supported() -> bool:
    return unsupported() is None
