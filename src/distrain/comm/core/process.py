"""A process as another process of the same host can see it in /proc: who it is, and whether it is stopped or gone.

Contract: :func:`identity` describes this process (pid, start time, boot id, PID namespace; it rides in a
fixed job's heartbeats, watchdog.py); :func:`state` says what this host sees of the process a heartbeat
names: "stopped", "gone", "alive" or "unknown" (another host, or no proof). The heartbeat is a value read
from the store, so every field is checked before it is used as a pid.
"""

from __future__ import annotations

import os


def identity() -> dict:
    """This process as another process of the same kernel and PID namespace can find it in /proc: its pid, its
    start time (field 22 of /proc/PID/stat: a reused pid has another), the kernel's boot id and the PID
    namespace. Empty where /proc is missing (then no rank is ever named early, only by the time-out)."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return {"pid": os.getpid(), "start": start, "boot": boot, "pidns": os.readlink("/proc/self/ns/pid")}
    except (OSError, ValueError, IndexError):
        return {}



def state(hb: dict | None, mine: dict) -> str:
    """What this host can see of the process that wrote heartbeat ``hb``: "stopped" (SIGSTOP, or traced),
    "gone" (exited, a zombie, or its pid now another process's), "alive" (running or sleeping), or "unknown"
    (no heartbeat, or another kernel or PID namespace: another host). ``mine``: this process's
    :func:`identity`.

    Why: a heartbeat that stops moving is not proof. Under a loaded CPU, or while the main thread holds the
    GIL in a long C call, a live rank's heartbeat thread can miss seconds of beats, and naming it would end a
    healthy job (seen in CI at load 12 on 2 cores: 1.3-2.6 s). So a quiet rank is named early only where its
    process is seen stopped or gone; otherwise the collective time-out decides, as before."""
    if hb is None or "boot" not in mine or hb.get("boot") != mine["boot"] or hb.get("pidns") != mine["pidns"]:
        return "unknown"
    pid, start = hb.get("pid"), hb.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int) or pid <= 0:
        return "unknown"
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    try:
        if int(fields[19]) != start:
            return "gone"
        state = fields[0]
    except (ValueError, IndexError):
        return "unknown"
    if state in ("T", "t"):
        return "stopped"
    return "gone" if state in ("Z", "X", "x") else "alive"
