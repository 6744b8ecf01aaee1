"""Async saves run on long-lived threads: reused when idle, a new one only when all are busy."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

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


def test_wait_idle_waits_until_every_thread_let_go_of_its_job() -> None:
    """A job reports its result before its thread drops it (and frees what it held): exit
    waits for that, since freeing tensors on a daemon thread while the interpreter finalizes
    aborts the process."""
    runner = BackgroundRunner("test-runner")
    assert runner.wait_idle(0)  # nothing started
    release, reported, dropped = threading.Event(), threading.Event(), threading.Event()

    class Held:
        def __del__(self) -> None:
            dropped.set()

    def job(held: Held = Held()) -> None:  # noqa: B008 - the job's own reference
        reported.set()
        release.wait(10)

    runner.submit(job)
    del job
    assert reported.wait(10)
    assert not runner.wait_idle(0.05)  # reported, but still running
    release.set()
    assert runner.wait_idle(10) and dropped.is_set()


def test_a_process_exits_only_after_its_save_threads_let_go(tmp_path: Path) -> None:
    """In a real process: the job reports, the main thread exits at once, and the thread's
    letting go (slow here) still ends before the interpreter finalizes."""
    marker = tmp_path / "dropped"
    script = f"""
import threading, time
import snapstate  # registers the exit hook
from snapstate.engine.background import run_in_background

class Held:
    def __del__(self):
        time.sleep(0.5)
        open({str(marker)!r}, "w").close()

reported = threading.Event()
def submit():
    def job(held=Held()):  # only the save thread refers to it once submit returns
        reported.set()
        time.sleep(0.1)
    run_in_background(job)
submit()
reported.wait(10)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert marker.exists()
