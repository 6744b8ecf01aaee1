"""Issue 12 item 2: real processes race to take over the same stale lock; exactly one wins.
A lock that cannot be judged from here (another host) is refused until break_lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snapstate as ss
from snapstate.lock import LOCK_FILE, break_lock
from support.procs import dead_pid

RACER = """
import os, sys, time
from pathlib import Path
import snapstate as ss
root, go = Path(sys.argv[1]), Path(sys.argv[2])
(root.parent / f"ready-{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.0005)
try:
    mgr = ss.CheckpointManager(root, async_save=False)
except ss.CheckpointLockedError:
    print("locked", flush=True)
    sys.exit(0)
print("acquired", flush=True)
time.sleep(3)  # hold it while the others try
mgr.close()
"""

RACERS = 4
# The children import the snapstate under test, wherever pytest found it.
SRC = str(Path(ss.__file__).resolve().parents[1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("trial", range(2))
def test_racing_takeover_of_a_stale_lock_is_exclusive(tmp_path: Path, trial: int) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(root), str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
            },
        )
        for _ in range(RACERS)
    ]
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("ready-*"))) < RACERS:
            assert time.monotonic() < deadline, "racers did not start"
            time.sleep(0.05)
        go.touch()
        outcomes = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert sorted(outcomes) == ["acquired"] + ["locked"] * (RACERS - 1), outcomes


def test_lock_from_another_host_needs_break_lock(tmp_path: Path) -> None:
    other = {"pid": 1, "host": "some-other-host", "token": "t"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(other))
    with pytest.raises(ss.CheckpointLockedError, match="break_lock"):
        ss.CheckpointManager(tmp_path)
    assert break_lock(tmp_path) == other
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"x": 1})
        assert mgr.steps() == [1]
