"""Issue 12 items 1, 9 and 10 on real files: a broken latest step does not block training, an
error seen on handle.wait() is not raised again, and every error met is a CheckpointError."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.engine.handle import SaveHandle
from snapstate.storage.local import LocalStorage
from support.bits import assert_bitwise_equal
from support.storages import Delegating, Fault, FaultyStorage


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(256), "step": -1}


def shard_of(step_dir: Path) -> Path:
    (shard,) = (step_dir / "shards").iterdir()
    return shard


def truncate_shard(d: Path) -> None:
    shard = shard_of(d)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def zero_shard(d: Path) -> None:
    shard = shard_of(d)
    shard.write_bytes(bytes(shard.stat().st_size))


def delete_shard(d: Path) -> None:
    shard_of(d).unlink()


def truncate_manifest(d: Path) -> None:
    raw = (d / "manifest.json").read_bytes()
    (d / "manifest.json").write_bytes(raw[: len(raw) // 2])


def zero_manifest(d: Path) -> None:
    (d / "manifest.json").write_bytes(bytes((d / "manifest.json").stat().st_size))


DAMAGES = [truncate_shard, zero_shard, delete_shard, truncate_manifest, zero_manifest]


@pytest.mark.parametrize("damage", DAMAGES)
def test_broken_latest_step_is_set_aside_and_training_goes_on(
    tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with ss.CheckpointManager(tmp_path, keep_last=2, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
    damage(tmp_path / "step-000000002")
    with (
        caplog.at_level(logging.WARNING, logger="snapstate"),
        ss.CheckpointManager(tmp_path, keep_last=2, async_save=False) as mgr,
    ):
        target = blank()
        assert mgr.restore(target) == 1
        assert target["step"] == 1
        assert_bitwise_equal(target["w"], torch.full((256,), 1.0))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("set aside" in w and "2" in w for w in warnings)
        assert mgr.latest_step() == 1 and mgr.steps() == [1]
        assert (tmp_path / "step-000000002.corrupt").is_dir()
        mgr.save(2, state_at(20))  # the loop's next save of the same step works
        mgr.save(3, state_at(3))
        assert mgr.steps() == [2, 3], "retention counts committed steps only"
        assert (tmp_path / "step-000000002.corrupt").is_dir(), "set aside, never deleted"
    with ss.CheckpointManager(tmp_path, keep_last=2) as mgr:
        target = blank()
        assert mgr.restore(target) == 3
        assert mgr.corrupt_steps == {}


def test_a_state_that_does_not_fit_sets_nothing_aside(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        with pytest.raises(ss.IncompatibleStateError):
            mgr.restore({"other": torch.zeros(3)}, step=1)
        assert mgr.restore({"other": torch.zeros(3)}) is None
        assert mgr.steps() == [1] and not list(tmp_path.glob("*.corrupt*"))


class FailOnce(Fault):
    """A Fault that fires only the first time its phase is reached."""

    def check(self, phase: str, what: str, end: int = 0) -> None:
        if self.fired == 0:
            super().check(phase, what, end)


def test_error_seen_on_handle_wait_is_not_raised_again(tmp_path: Path) -> None:
    storage = FaultyStorage(LocalStorage(str(tmp_path)), FailOnce("write_manifest"))
    with ss.CheckpointManager(storage, async_save=True) as mgr:
        handle = mgr.save(1, state_at(1))
        with pytest.raises(ss.CheckpointError):
            handle.wait()
        handle2 = mgr.save(2, state_at(2))  # raised step 1's error again before the fix
        handle2.wait()
        mgr.wait()
        assert mgr.steps() == [2]
        target = blank()
        assert mgr.restore(target) == 2 and target["step"] == 2


def test_error_not_seen_is_raised_by_the_next_save(tmp_path: Path) -> None:
    storage = FaultyStorage(LocalStorage(str(tmp_path)), FailOnce("write_manifest"))
    with ss.CheckpointManager(storage, async_save=True) as mgr:
        mgr.save(1, state_at(1))
        with pytest.raises(ss.CheckpointError):
            mgr.save(2, state_at(2))
        mgr.save(3, state_at(3))
        mgr.wait()
        assert mgr.steps() == [3]


def test_handle_wait_timeout_is_a_checkpoint_error() -> None:
    release = threading.Event()
    handle = SaveHandle(run=lambda: (release.wait(10), time.sleep(0))[1])  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(ss.CheckpointTimeoutError):
            handle.wait(0.05)
    finally:
        release.set()


def test_inconsistent_state_error_is_a_checkpoint_error() -> None:
    from snapstate.planning.validate import InconsistentStateError

    assert issubclass(InconsistentStateError, ss.CheckpointError)
    assert issubclass(InconsistentStateError, ValueError)


class VanishingManifest(Delegating):
    """The manifest disappears between listing the step and reading it (a retention race)."""

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        os.unlink(os.path.join(self.root, path))
        return self.inner.read_bytes(path, offset, length)


class FailingReads(Delegating):
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        raise OSError(errno.EIO, "Input/output error", os.path.join(self.root, path))


def test_manifest_race_and_io_errors_are_checkpoint_errors(tmp_path: Path) -> None:
    ss.save(state_at(1), tmp_path / "c")
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(blank(), VanishingManifest(LocalStorage(str(tmp_path / "c"))))
    ss.save(state_at(1), tmp_path / "d")
    with pytest.raises(ss.CheckpointIOError) as info:
        ss.load(blank(), FailingReads(LocalStorage(str(tmp_path / "d"))))
    assert info.value.errno == errno.EIO and "manifest.json" in str(info.value.filename)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "symlink_to_dev_zero", "symlink_outside"])
def test_manifest_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    ss.save(state_at(1), tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    real = manifest.read_bytes()
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "symlink_to_dev_zero":
        manifest.symlink_to("/dev/zero")
    else:
        (tmp_path / "elsewhere.json").write_bytes(real)
        manifest.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ss.CorruptCheckpointError, match="regular file"):
        ss.load(blank(), tmp_path / "c")


def test_manifest_over_the_cap_is_refused_before_parsing(tmp_path: Path) -> None:
    """A regular but oversized manifest (sparse: no disk used) is refused by its size as read,
    not parsed: parsing costs about 12x the file in memory."""
    from snapstate.format.manifest import MAX_MANIFEST_BYTES

    ss.save(state_at(1), tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    with manifest.open("r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ss.CorruptCheckpointError, match="cap") as info:
        ss.load(blank(), tmp_path / "c")
    assert "manifest.json" in str(info.value)
