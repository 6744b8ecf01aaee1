"""Async saves run on long-lived threads: reused when idle, a new one only when all are busy."""

from __future__ import annotations

import threading

from snapstate.engine.background import BackgroundRunner


def test_an_idle_thread_takes_the_next_job() -> None:
    runner = BackgroundRunner("test-runner")
    names: list[str] = []
    for _ in range(5):
        done = threading.Event()
        runner.submit(lambda d=done: (names.append(threading.current_thread().name), d.set()))
        assert done.wait(10)
    assert runner.threads == 1 and len(set(names)) == 1


def test_busy_threads_do_not_hold_up_a_new_job() -> None:
    runner = BackgroundRunner("test-runner")
    release, started = threading.Event(), threading.Semaphore(0)

    def blocked() -> None:
        started.release()
        release.wait(10)

    runner.submit(blocked)
    assert started.acquire(timeout=10)
    done = threading.Event()
    runner.submit(done.set)  # the first thread is busy: this one must not wait for it
    assert done.wait(10)
    assert runner.threads == 2
    release.set()


def test_worker_threads_are_daemons() -> None:
    runner = BackgroundRunner("test-runner")
    seen: list[bool] = []
    done = threading.Event()
    runner.submit(lambda: (seen.append(threading.current_thread().daemon), done.set()))
    assert done.wait(10) and seen == [True]
