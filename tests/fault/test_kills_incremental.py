"""Real kills of incremental saves: a manager saving with ``incremental=True`` (most bytes
referenced from the previous step) SIGKILLed at each phase of a save and of retention.

After every kill each committed step verifies and loads bit for bit what was saved at that
step, every file a committed step references is still there, and a new manager removes the
leftovers (keeping referenced files) and restores the latest committed step.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.procs import wait_for

from .killing import ForkServer, Run, check_root, recover
from .saver_child import PHASES, incremental_state
from .test_kills import NTH, SIGNAL_TIMEOUT, _alive, _await_pause, _paths


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fs = ForkServer()
    yield fs
    fs.close()


def incremental_run(root: Path, work: Path, steps: int, **extra: object) -> Run:
    return Run(root, work, "manager", first=0, steps=steps, extra={"incremental": True, **extra})


def references(root: Path, step: int) -> list[str]:
    doc = json.loads((root / f"step-{step:09d}" / "manifest.json").read_bytes())
    return [f for f in doc["files"] if f.startswith("../")]


@pytest.mark.parametrize("phase", [p for p in PHASES if p != "retention"])
def test_kill_incremental_save_at_phase(server: ForkServer, tmp_path: Path, phase: str) -> None:
    root, work = _paths(tmp_path)
    run = incremental_run(root, work, 3, max_file_bytes=8 << 20)  # a few files per step
    run.pause = {"phase": phase, "step": 2, "nth": NTH.get(phase, 1)}
    pid = server.start(run.describe())
    try:
        _await_pause(run, lambda: _alive(pid))
    finally:
        server.kill(pid)
    assert not run.errors(), run.log()
    report = check_root(root, incremental_state)
    want = [0, 1, 2] if phase == "renamed" else [0, 1]
    assert report.committed == want, run.log()
    assert references(root, 1), "step 1 should reference step 0's unchanged bytes"
    assert recover(root, report, incremental_state) == max(want)


@pytest.mark.parametrize("phase", ["retention", "retention_file"])
def test_kill_incremental_retention(server: ForkServer, tmp_path: Path, phase: str) -> None:
    """Killed once retention uncommitted step 0 (whose frozen bytes step 1 references), or
    while it deletes step 0's unreferenced files."""
    root, work = _paths(tmp_path)
    # files of at most 4 MiB: some hold only changing tensors, which retention deletes
    run = incremental_run(root, work, 3, keep_last=1, max_file_bytes=4 << 20)
    run.pause = {"phase": phase, "step": 0, "nth": 1}
    pid = server.start(run.describe())
    try:
        _await_pause(run, lambda: _alive(pid))
    finally:
        server.kill(pid)
    assert not run.errors(), run.log()
    report = check_root(root, incremental_state)
    assert report.committed == [1] and report.uncommitted == [0]
    assert all(f.startswith("../step-000000000/") for f in references(root, 1))
    assert recover(root, report, incremental_state) == 1
    assert (root / "step-000000000" / "shards").is_dir()  # the referenced file stays


def _random_incremental_kills(server: ForkServer, tmp_path: Path, rounds: int, seed: int) -> None:
    """A resuming incremental job with retention, killed at random moments, on one root."""
    root, work = _paths(tmp_path)
    rng = random.Random(seed)
    latest: int | None = None
    for i in range(rounds):
        run = Run(root, work, "manager", first=None, steps=4)
        run.extra = {"incremental": True, "keep_last": 2}
        delay = rng.uniform(0.0, 1.5)
        pid = server.start(run.describe())
        try:
            wait_for(
                lambda r=run, p=pid: any(x.startswith("ready") for x in r.log()) or not _alive(p),
                SIGNAL_TIMEOUT,
                "the saver's 'ready' line",
            )
            time.sleep(delay)
        finally:
            server.kill(pid)
        context = f"round {i} (killed {delay:.3f}s after 'ready'), log {run.log()}"
        assert not run.errors(), context
        if latest is not None:
            assert f"restored {latest} ok" in run.log(), context
        report = check_root(root, incremental_state)
        if run.committed():  # retention (keep_last=2) may have deleted older ones since
            assert max(run.committed()) in report.committed, context
        latest = recover(root, report, incremental_state)


def test_random_kills_incremental(server: ForkServer, tmp_path: Path) -> None:
    _random_incremental_kills(server, tmp_path, rounds=3, seed=34)


@pytest.mark.slow
def test_random_kills_incremental_long(server: ForkServer, tmp_path: Path) -> None:
    _random_incremental_kills(server, tmp_path, rounds=30, seed=int(time.time()))
