"""Child processes for tests: a server that answers JSON lines, a child that reports them,
waiting, reaping a process group."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.005
) -> None:
    """Return once ``predicate()`` holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll_s)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (a stale lock's holder)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def reap_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL what is left of ``proc``'s process group (orphaned workers too) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class LineServer:
    """A Python script run as a child that reads one JSON object per line on stdin and answers
    each with one JSON line: the fork servers of the kill and multi-rank tests (they import torch
    once and fork a process per run, so many runs stay cheap)."""

    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.script = script
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )

    def ask(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send ``message``; its answer. A server that dies or stays silent fails the test."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        ready = timeout is None or select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            name = os.path.basename(self.script)
            raise AssertionError(
                f"{name} gave no answer to {str(message)[:200]} (exit {self.proc.poll()})"
            )
        return json.loads(line)

    def close(self) -> None:
        """End the server: it exits when its stdin closes (killed if it does not within 10 s)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class JsonLinesChild:
    """``python SCRIPT ARGS...`` with this process's import path; ``line()`` reads its next report."""

    def __init__(self, script: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.name = os.path.basename(script)
        self.proc = subprocess.Popen(
            [sys.executable, script, *args], stdout=subprocess.PIPE, text=True, env=env
        )

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, f"{self.name} exited with {self.proc.wait()}"
        return json.loads(text)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
