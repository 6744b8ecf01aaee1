"""Real kills: a saver process SIGKILLed at chosen phases and at random moments of its saves.

After every kill each checkpoint directory is either committed (verifies, loads bit for bit
what was saved at that step) or invisible (no manifest.json), earlier checkpoints are intact,
and a new CheckpointManager removes the leftovers and restores the latest committed step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.procs import wait_for

from .killing import CHILD, ForkServer, Run, check_root, prune, recover
from .saver_child import PHASES

SIGNAL_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fs = ForkServer()
    yield fs
    fs.close()


def _paths(tmp_path: Path) -> tuple[Path, Path]:
    root, work = tmp_path / "root", tmp_path / "work"
    root.mkdir()
    work.mkdir()
    return root, work


def _await_pause(run: Run, alive: Callable[[], bool]) -> None:
    def paused_or_dead() -> bool:
        if run.signal.exists():
            return True
        if not alive():
            raise AssertionError(f"saver exited before pausing; its log: {run.log()}")
        return False

    wait_for(paused_or_dead, SIGNAL_TIMEOUT, f"phase {run.pause}")


def _expect_after_pause(
    root: Path, run: Run, committed_before: list[int], paused_step: int, committed_now: bool
) -> None:
    assert not run.errors(), run.log()
    report = check_root(root)
    want = sorted([*committed_before, paused_step]) if committed_now else sorted(committed_before)
    assert report.committed == want, (
        f"committed {report.committed}, expected {want} (log {run.log()})"
    )
    assert set(run.committed()) <= set(report.committed)
    assert recover(root, report) == max(want)


def test_kill_plain_process_mid_write(tmp_path: Path) -> None:
    """One run without the fork server: a freshly started interpreter, killed mid-persist."""
    root, work = _paths(tmp_path)
    run = Run(root, work, "async", first=0, steps=3, pause={"phase": "write", "step": 1, "nth": 3})
    proc = subprocess.Popen([sys.executable, CHILD, json.dumps(run.describe())])
    try:
        _await_pause(run, lambda: proc.poll() is None)
        assert (root / "step-000000001" / "shards").is_dir()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _expect_after_pause(root, run, [0], 1, committed_now=False)


# The nth event of a phase to stop at: mid-staging and mid-writing rather than at their start.
NTH = {"stage": 3, "write": 5}
# Every phase for the blocking save and the manager's async save; the plain async save with a
# small streaming pool shares their commit path, so it runs the phases where it differs.
PHASE_CASES = [
    (phase, mode) for mode in ("save", "manager") for phase in PHASES if phase != "retention"
]
PHASE_CASES += [("stage", "async"), ("write", "async"), ("marker", "async")]


@pytest.mark.parametrize(("phase", "mode"), PHASE_CASES)
def test_kill_at_phase(server: ForkServer, tmp_path: Path, phase: str, mode: str) -> None:
    root, work = _paths(tmp_path)
    run = Run(
        root,
        work,
        mode,
        first=0,
        steps=2,
        pause={"phase": phase, "step": 1, "nth": NTH.get(phase, 1)},
    )
    pid = server.start(run.describe())
    try:
        _await_pause(run, lambda: _alive(pid))
    finally:
        server.kill(pid)
    _expect_after_pause(root, run, [0], 1, committed_now=phase == "renamed")


def test_kill_during_retention(server: ForkServer, tmp_path: Path) -> None:
    """Killed after retention uncommitted step 0 (manifest removed) but before deleting its bytes."""
    root, work = _paths(tmp_path)
    run = Run(
        root,
        work,
        "manager",
        first=0,
        steps=3,
        pause={"phase": "retention", "step": 0, "nth": 1},
        extra={"keep_last": 1},
    )
    pid = server.start(run.describe())
    try:
        _await_pause(run, lambda: _alive(pid))
    finally:
        server.kill(pid)
    report = check_root(root)
    assert report.committed == [1] and report.uncommitted == [0]
    assert recover(root, report) == 1


def _alive(pid: int) -> bool:
    # The fork server reaps its children only on request, so a dead child is a zombie until then.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _random_kills(server: ForkServer, tmp_path: Path, rounds: int, seed: int) -> None:
    """Kill a resuming training job at random moments, over and over, on the same root."""
    root, work = _paths(tmp_path)
    rng = random.Random(seed)
    latest: int | None = None
    rounds_with_commits = 0
    for i in range(rounds):
        mode = ("manager", "async", "save")[i % 3]
        first = None if mode == "manager" else _next_step(root)
        run = Run(root, work, mode, first=first, steps=5)
        delay = rng.uniform(0.0, 1.8)
        # Every other round counts the delay from the first commit, so that however slow the
        # machine, half the kills land after a commit, in the middle of later saves.
        anchor = "ready" if i % 2 == 0 else "committed"
        pid = server.start(run.describe())
        try:
            wait_for(
                lambda r=run, p=pid, a=anchor: (
                    any(x.startswith(a) for x in r.log()) or not _alive(p)
                ),
                SIGNAL_TIMEOUT,
                f"the saver's first {anchor!r} line",
            )
            time.sleep(delay)
        finally:
            server.kill(pid)
        context = f"round {i} ({mode}, killed {delay:.3f}s after {anchor!r}), log {run.log()}"
        assert not run.errors(), context
        if mode == "manager" and latest is not None:
            assert f"restored {latest} ok" in run.log(), context
        report = check_root(root)
        assert set(run.committed()) <= set(report.committed), context
        if latest is not None:
            assert latest in report.committed, f"an earlier checkpoint vanished: {context}"
        new = [s for s in report.committed if latest is None or s > latest]
        rounds_with_commits += bool(new)
        latest = recover(root, report)
        prune(root, keep=2)
    assert rounds_with_commits >= rounds // 2, (
        f"only {rounds_with_commits} of {rounds} rounds committed anything"
    )


def _next_step(root: Path) -> int:
    steps = [int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")]
    return max(steps, default=-1) + 1


def test_random_kills(server: ForkServer, tmp_path: Path) -> None:
    _random_kills(server, tmp_path, rounds=10, seed=1234)


@pytest.mark.slow
def test_random_kills_long(server: ForkServer, tmp_path: Path) -> None:
    _random_kills(server, tmp_path, rounds=60, seed=int(time.time()))
