"""Two workers with a replicated TF / Chainer model write the state once, about half each."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import snapstate as ss

WORKER = Path(__file__).with_name("dedup_worker.py")
FRAMEWORKS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            importlib.util.find_spec(name) is None, reason=f"needs {name}: make test-frameworks"
        ),
    )
    for name in ("tensorflow", "chainer")
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.dist
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_two_workers_write_the_state_once(framework: str, tmp_path: Path) -> None:
    port, ck = str(_free_port()), str(tmp_path / "ck")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), framework, str(r), "2", port, ck],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    rows = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    state = rows[0]["state"]
    total = sum(r["written"] for r in rows)
    # once, not twice: the chunk files hold the state plus small per-file headers
    assert state <= total < 1.2 * state, rows
    for row in rows:
        assert 0.3 * state < row["written"] < 0.7 * state, rows
    assert ss.verify(ck).ok
