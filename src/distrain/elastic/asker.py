"""Calls run in order on a thread of their own: rank 0's store round trips of each step (member.py), asked at
the step's start and answered while the step computes, so that no round trip to the coordinator's store sits
on the step's path."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class Asker:
    """One daemon thread that runs calls in the order submitted (rank 0's store round trips of each step,
    while the step computes); :meth:`submit` returns the call's Future (its result or its exception)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="distrain-elastic-asker", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        self.jobs.put((fn, args, done))
        return done

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, done = job
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever takes the result
                done.set_exception(e)


__all__ = ["Asker"]
