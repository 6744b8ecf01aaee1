"""Long-lived daemon threads that run the background half of async saves.

Starting a thread per save cost about a millisecond of the training thread's stall (the
start waits until the new thread runs, longer on a loaded machine); an idle thread waiting
on a queue takes the next save at the cost of a put. Daemon threads, as before: a save stuck
on a dead peer must not keep the interpreter from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

THREAD_NAME = "snapstate-save"  # the prefix keeps collectives on the training group out


class BackgroundRunner:
    """Runs each submitted job on an idle worker thread, starting one only when none is idle."""

    def __init__(self, name: str = THREAD_NAME) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # that thread's next get() takes this job
                self._jobs.put(job)
                return
            self._started += 1
            name = f"{self._name}-{self._started}"
        threading.Thread(target=self._work, args=(job,), name=name, daemon=True).start()

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()  # jobs catch their own errors (SaveHandle keeps them for wait())
            del job
            with self._lock:
                self._idle += 1
            job = self._jobs.get()

    @property
    def threads(self) -> int:
        return self._started


_runner = BackgroundRunner()


def run_in_background(job: Callable[[], None]) -> None:
    """Run ``job`` on one of the process's save threads."""
    _runner.submit(job)
