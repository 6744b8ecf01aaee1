"""Child of the lock-race tests: opens a CheckpointManager on a root another process opens.

``python lock_racer.py WORK ROOT ROUNDS OPTIONS_JSON``: for each round it says it is ready,
waits for the parent's go file, opens a manager on ``ROOT/round-N`` (a path or a URL, with
fsspec storage options for a URL) and reports whether it got the lock, then holds it until
the parent's done file appears.
"""

from __future__ import annotations

import json
import os
import sys
import time

import snapstate as ss
from snapstate.storage.base import Storage
from snapstate.storage.fsspec import FsspecStorage
from snapstate.storage.local import LocalStorage


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.0002)


def _storage(root: str, options: dict) -> Storage:
    return FsspecStorage(root, **options) if "://" in root else LocalStorage(root)


def main(work: str, root: str, rounds: int, options: dict) -> None:
    for r in range(rounds):
        storage = _storage(f"{root}/round-{r}", options)
        print(json.dumps({"ready": r}), flush=True)
        _wait_for(os.path.join(work, f"go-{r}"))
        manager = None
        try:
            manager = ss.CheckpointManager(storage)
            outcome = "held"
        except ss.CheckpointLockedError:
            outcome = "locked"
        except BaseException as exc:  # noqa: BLE001 - the parent reports anything else
            outcome = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"round": r, "outcome": outcome}), flush=True)
        _wait_for(os.path.join(work, f"done-{r}"))
        if manager is not None:
            manager.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
