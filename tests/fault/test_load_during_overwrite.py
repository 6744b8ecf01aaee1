"""Issue 31 item 8: a load never lets a raw OSError out, even while its checkpoint changes.

One real process overwrites a checkpoint in a loop while this one loads it: every load
either gets one whole save or raises a CheckpointError. Deterministically: a shard removed
between planning and reading, or an I/O error in a read, is a CheckpointError naming the
file, on every read path.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.storage.local import LocalFileReader, LocalStorage
from support.procs import JsonLinesChild

from .corrupt import SHARD
from .overwriting_saver import TENSORS, version_state

CHILD = str(Path(__file__).with_name("overwriting_saver.py"))
LOAD_SECONDS = 3.0


def _blank() -> dict[str, Any]:
    return {f"t{i}": torch.full((1 << 16,), -1.0) for i in range(TENSORS)} | {"v": -1}


def _one_whole_save(values: dict[str, Any]) -> None:
    """Every tensor holds the version the plain value names: not a mix of two saves."""
    want = version_state(values["v"])
    mixed = [k for k in want if k != "v" and not torch.equal(values[k], want[k])]
    assert not mixed, f"version {values['v']}: {mixed} hold another save's bytes"


def _load_once(path: Path, turn: int) -> str:
    """One load, by a path that changes with ``turn``; what came of it."""
    try:
        if turn % 2:
            _one_whole_save(ss.read_state(path))
        else:
            target = _blank()
            ss.load(target, path)
            _one_whole_save(target)
        return "ok"
    except ss.CheckpointError as exc:
        return type(exc).__name__


def _saves_made(stop: Path) -> int:
    try:
        return int(Path(f"{stop}.count").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def test_loads_during_an_overwrite_loop_see_one_save_or_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    """Loads for a few seconds, and at least while the saver commits three more saves
    (however slow the machine): anything but a whole save or a CheckpointError fails."""
    path, stop = tmp_path / "ckpt", tmp_path / "stop"
    saver = JsonLinesChild(CHILD, str(path), str(stop))
    outcomes: dict[str, int] = {}
    try:
        assert saver.line() == {"saved": 1}
        deadline = time.monotonic() + LOAD_SECONDS
        turn = 0
        while time.monotonic() < deadline or _saves_made(stop) < 4:
            assert saver.proc.poll() is None, "the saver exited"
            outcome = _load_once(path, turn)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            turn += 1
        stop.touch()
        report = saver.line()
    finally:
        saver.close()
    assert report["error"] is None, report["error"]
    assert sum(outcomes.values()) >= 2, outcomes  # each a whole save or a CheckpointError
    _one_whole_save(ss.read_state(path))  # the last commit is whole, and loads


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    ss.save(version_state(3), path)
    return path


def _remove_after_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard goes right after the load mapped it, before its reader opens it: what a
    concurrent overwrite does at the worst moment."""
    real = LocalStorage.map_file

    def map_then_remove(self: LocalStorage, path: str) -> Any:
        mapped = real(self, path)
        os.remove(os.path.join(self.root, path))
        return mapped

    monkeypatch.setattr(LocalStorage, "map_file", map_then_remove)


def _remove_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard goes once the load has planned (headers checked) and starts to read."""
    real = LocalFileReader.__init__

    def open_removed(self: LocalFileReader, full_path: str) -> None:
        if os.path.exists(full_path):
            os.remove(full_path)
        real(self, full_path)

    monkeypatch.setattr(LocalFileReader, "__init__", open_removed)


def _eio_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fails a read: a plain OSError(EIO) from the reader."""

    def fail(self: Any, offset: int, out: memoryview) -> None:
        raise OSError(errno.EIO, "Input/output error", getattr(self, "full_path", "?"))

    monkeypatch.setattr(LocalFileReader, "read_into", fail)
    monkeypatch.setattr(
        LocalFileReader, "read_many", lambda self, offset, buffers: fail(self, 0, buffers[0])
    )


FAULTS = {
    "removed-after-mapping": (
        _remove_after_mapping,
        ss.CorruptCheckpointError,
        "removed while loading",
    ),
    "removed-before-reading": (
        _remove_before_reading,
        ss.CorruptCheckpointError,
        "removed while loading",
    ),
    "io-error": (_eio_reading, ss.CheckpointIOError, "Input/output error"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_file_gone_or_failing_mid_load_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    path = _saved(tmp_path)
    inject, error, says = FAULTS[fault]
    inject(monkeypatch)
    target = _blank()
    with pytest.raises(error, match=says) as info:
        ss.load(target, path)
    assert SHARD in str(info.value), str(info.value)
    assert all(torch.equal(target[f"t{i}"], _blank()[f"t{i}"]) for i in range(TENSORS))
    assert target["v"] == -1, "a failed load replaced a plain value"


def test_a_file_gone_mid_read_state_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved(tmp_path)
    _remove_before_reading(monkeypatch)
    with pytest.raises(ss.CorruptCheckpointError, match="removed while loading") as info:
        ss.read_state(path)  # own reads, whole chunks through one reader per file
    assert SHARD in str(info.value)
