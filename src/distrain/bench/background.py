"""``--background-load N``: N busy processes beside a benchmark, so contention is reproducible.

A busy process is a tight CPU loop (one core's worth of work, like ``yes > /dev/null``), not
pinned: it inherits the benchmark's CPU affinity and the scheduler places it. The benchmark
starts them before it measures and stops them after (:class:`BackgroundLoad`, a context
manager: SIGKILL and reap in ``__exit__``, so an error, Ctrl-C or SIGTERM, which
:func:`distrain.lifeline.stop_on_signals` turns into an exception, ends them too). Should the
benchmark itself be killed (SIGKILL included), each busy process dies with it: it asks the
kernel for ``PR_SET_PDEATHSIG`` = SIGKILL (as :func:`distrain.lifeline.die_with_parent` does
for ranks) before it reports ready, and where prctl is missing a thread polls its parent.

Every measurement records the load average (:func:`os.getloadavg`: 1, 5 and 15 minutes) at its
start and end; :func:`summary` is the one line printed with the tables.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Sequence

from distrain.errors import ConfigError, DistrainError

FLAG = "--background-load"
PER_CORE_MAX = 64  # more busy processes per usable core than this is a typo, not an experiment
READY_TIMEOUT_S = 30.0

# The busy process: plain Python without site (-I -S), nothing imported but the standard library.
# argv[1] is the pid it must die with. It sets PR_SET_PDEATHSIG before it reports ready (one byte on
# stdout), so a benchmark killed after start() returned cannot leave it behind.
_BUSY = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
parent = int(sys.argv[1])
ok = False
try:
    import ctypes
    ok = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0
except Exception:
    pass
if os.getppid() != parent:
    os._exit(125)
if not ok:
    import threading, time
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(125)
    threading.Thread(target=watch, daemon=True).start()
os.write(1, b"1")
os.close(1)
while True:
    pass
"""


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse(value) -> int:
    """The flag's value as a count: 0 to PER_CORE_MAX per usable core, else a one-line ConfigError."""
    cores = usable_cores()
    top = PER_CORE_MAX * cores
    allowed = f"allowed: 0 to {top} ({PER_CORE_MAX} per usable core, {cores} usable)"
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{FLAG} {value!r}: not an integer; {allowed}") from None
    if not 0 <= n <= top:
        raise ConfigError(f"{FLAG} {n}: out of range; {allowed}")
    return n


def loadavg() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


_active: list["BackgroundLoad"] = []


def running_pids() -> list[int]:
    """The pids of the busy processes this process has started and not yet stopped."""
    return [pid for load in _active for pid in load.pids]


class BackgroundLoad:
    """``with BackgroundLoad(n): measure()``: n busy processes alive for the block, none after it."""

    def __init__(self, n: int):
        if n < 0:
            raise ConfigError(f"{FLAG} {n}: out of range; allowed: 0 or more")
        self.n = n
        self._procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> "BackgroundLoad":
        if self.n and not self._procs:
            _active.append(self)
            try:
                for _ in range(self.n):
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-I", "-S", "-c", _BUSY, str(os.getpid())],
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
                self._wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for p in self._procs:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready or p.stdout.read(1) != b"1":
                raise DistrainError(f"{FLAG}: busy process {p.pid} did not start "
                                    f"(exit status {p.poll()}); nothing was measured")
            p.stdout.close()

    def stop(self) -> None:
        """SIGKILL every busy process and reap it (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            p.wait()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()
        self._procs = []
        if self in _active:
            _active.remove(self)

    def __enter__(self) -> "BackgroundLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def window(label: dict, start: list[float] | None, end: list[float] | None) -> dict:
    """One measurement's entry in the JSON metadata."""
    return {**label, "loadavg_start": start, "loadavg_end": end}


def meta(n: int, windows: Sequence[dict]) -> dict:
    """What the JSON metadata records about the load: N and every measurement's load averages."""
    return {"background_load": n, "usable_cores": usable_cores(), "loadavg_per_measurement": list(windows),
            "loadavg_note": "os.getloadavg() (1, 5, 15 min) at the start and end of each measurement"}


def summary(n: int, windows: Sequence[dict]) -> str:
    """One line for the table: N and the 1-minute load average over the measurements."""
    ones = [w[k][0] for w in windows for k in ("loadavg_start", "loadavg_end") if w.get(k)]
    head = f"background load: {n} busy process{'es' if n != 1 else ''} on {usable_cores()} usable core(s)"
    if not ones:
        return f"# {head}; load average unavailable"
    first, last = windows[0].get("loadavg_start"), windows[-1].get("loadavg_end")
    return (f"# {head}; load average (1 min) {first[0] if first else '-'} at start, {last[0] if last else '-'} "
            f"at end, {min(ones)}-{max(ones)} over {len(windows)} measurement(s)")
