"""Long-lived daemon threads that run the background half of async saves.

Starting a thread per save cost about a millisecond of the training thread's stall (the
start waits until the new thread runs, longer on a loaded machine); an idle thread waiting
on a queue takes the next save at the cost of a put. Daemon threads, as before: a save stuck
on a dead peer must not keep the interpreter from exiting.

A job reports its result before its thread lets go of it, and letting go frees the save's
tensors. Freeing a tensor releases the GIL; a daemon thread that asks for it back while the
interpreter finalizes is ended inside torch's C++ code, which aborts the whole process
("terminate called without an active exception", exit -6, after a run that succeeded). So
at exit the process waits, briefly, for every thread to be idle (``wait_idle``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

THREAD_NAME = "snapstate-save"  # the prefix keeps collectives on the training group out


class BackgroundRunner:
    """Runs each submitted job on an idle worker thread, starting one only when none is idle."""

    def __init__(self, name: str = THREAD_NAME) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle_changed = threading.Condition(self._lock)
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
        # The job goes in a list the thread empties: Thread keeps its args for as long as it
        # runs (here, the process), which would keep the first save's buffers alive.
        threading.Thread(target=self._work, args=([job],), name=name, daemon=True).start()

    def _work(self, first: list[Callable[[], None]]) -> None:
        job = first.pop()
        while True:
            job()  # jobs catch their own errors (SaveHandle keeps them for wait())
            del job  # frees what the job held: a save's staged tensors
            with self._lock:
                self._idle += 1
                self._idle_changed.notify_all()
            job = self._jobs.get()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every thread finished its job and let go of it within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._idle < self._started:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle_changed.wait(left)
            return True

    @property
    def threads(self) -> int:
        return self._started


_runner = BackgroundRunner()


def run_in_background(job: Callable[[], None]) -> None:
    """Run ``job`` on one of the process's save threads."""
    _runner.submit(job)


def wait_until_idle(timeout: float) -> bool:
    """Whether the process's save threads are all idle within ``timeout`` (at exit)."""
    return _runner.wait_idle(timeout)
