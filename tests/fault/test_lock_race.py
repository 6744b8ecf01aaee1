"""Two managers opening one root at the same moment: exactly one gets the lock, on a local
disk (the lock is hard-linked into place) and on S3 (a PUT with ``If-None-Match: *``, on a
real moto server). Issue 31 item 10: on S3 both took the lock in 8 of 20 races."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from conformance.s3 import BUCKET, S3Server, aws_test_credentials, s3_server  # noqa: F401
from support.procs import JsonLinesChild

CHILD = str(Path(__file__).with_name("lock_racer.py"))
ROUNDS = 8


def _race(work: Path, root: str, options: dict[str, Any]) -> list[list[str]]:
    args = (str(work), root, str(ROUNDS), json.dumps(options))
    racers = [JsonLinesChild(CHILD, *args) for _ in range(2)]
    outcomes = []
    try:
        for r in range(ROUNDS):
            for racer in racers:
                assert racer.line() == {"ready": r}
            (work / f"go-{r}").touch()
            outcomes.append(sorted(racer.line()["outcome"] for racer in racers))
            (work / f"done-{r}").touch()
        for racer in racers:
            assert racer.proc.wait(timeout=60) == 0
    finally:
        for racer in racers:
            racer.close()
    return outcomes


@pytest.mark.timeout(300)
def test_one_of_two_managers_on_a_local_root_gets_the_lock(tmp_path: Path) -> None:
    outcomes = _race(tmp_path, str(tmp_path / "runs"), {})
    assert outcomes == [["held", "locked"]] * ROUNDS


@pytest.mark.timeout(300)
def test_one_of_two_managers_on_s3_gets_the_lock(tmp_path: Path, s3_server: S3Server) -> None:  # noqa: F811
    root = f"s3://{BUCKET}/lock-race-{uuid.uuid4().hex[:8]}"
    outcomes = _race(tmp_path, root, s3_server.options)
    assert outcomes == [["held", "locked"]] * ROUNDS
