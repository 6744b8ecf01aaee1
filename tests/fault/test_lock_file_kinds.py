"""Issue 31 item 6: a lock file that is not a small regular file is refused within a second."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import snapstate as ss
from snapstate.lock import LOCK_FILE


def _devzero(p: Path) -> None:
    os.symlink("/dev/zero", p)


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _directory(p: Path) -> None:
    p.mkdir()


def _huge(p: Path) -> None:
    with open(p, "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB of zeros, no disk


@pytest.mark.parametrize("make", [_devzero, _fifo, _directory, _huge], ids=lambda f: f.__name__)
def test_a_lock_file_of_another_kind_is_refused_naming_it(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    make(tmp_path / LOCK_FILE)
    outcome: list[BaseException | None] = []

    def open_manager() -> None:
        try:
            ss.CheckpointManager(tmp_path).close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    thread = threading.Thread(target=open_manager, daemon=True)  # a hang must not hang pytest
    thread.start()
    thread.join(timeout=5.0)  # "within a second", with room for a loaded machine
    assert outcome, "the manager hung on the lock file"
    (error,) = outcome
    assert isinstance(error, (ss.CheckpointLockedError, ss.CorruptCheckpointError)), repr(error)
    assert LOCK_FILE in str(error)
