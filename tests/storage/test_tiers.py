"""TieredStorage: the durable tier gets a complete checkpoint, manifest last; reads prefer local."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

import snapstate as ss
from conformance.s3 import BUCKET, S3Server
from snapstate.format.manifest import MANIFEST
from snapstate.storage.base import FileWriter, Storage
from snapstate.storage.local import LocalStorage
from snapstate.storage.tiers import TieredStorage
from support.states import assert_same_state, training_state
from support.storages import CountingStorage, Delegating


class _LoggedWriter:
    def __init__(self, owner: EventLog, path: str, inner: FileWriter) -> None:
        self.owner, self.path, self.inner = owner, path, inner
        self.sequential = inner.sequential

    def write_at(self, data: memoryview, offset: int) -> None:
        self.inner.write_at(data, offset)

    def close(self, sync: bool = True) -> None:
        self.inner.close(sync)
        self.owner.record("close", self.path)

    def abort(self) -> None:
        self.inner.abort()


class EventLog(Delegating):
    """Records every mutation that reaches the wrapped (durable) tier, in order."""

    def __init__(self, inner: Storage, fail_under: str | None = None) -> None:
        super().__init__(inner)
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.fail_under = fail_under

    def record(self, op: str, path: str) -> None:
        with self.lock:
            self.events.append((op, f"{self.root}/{path}"))

    def open_writer(self, path: str, size: int) -> FileWriter:
        if self.fail_under and f"{self.root}/{path}".startswith(self.fail_under):
            raise OSError("injected: durable tier unreachable")
        return _LoggedWriter(self, path, self.inner.open_writer(path, size))

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)
        self.record("put", path)

    def child(self, path: str) -> EventLog:
        child = EventLog(self.inner.child(path), self.fail_under)
        child.events, child.lock = self.events, self.lock  # one log for the whole tree
        return child


def _durable(s3_server: S3Server) -> Storage:
    return s3_server.storage(f"s3://{BUCKET}/{uuid.uuid4().hex}")


def test_durable_tier_alone_holds_the_committed_checkpoint(
    s3_server: S3Server, tmp_path: Path
) -> None:
    durable = _durable(s3_server)
    state = training_state(seed=0, width=64)
    ss.save(state, TieredStorage(LocalStorage(str(tmp_path / "fast")), durable), step=1)
    assert ss.verify(durable).ok  # the S3 copy is complete, without the local tier
    restored = training_state(seed=1, width=64)
    ss.load(restored, durable)
    assert_same_state(state, restored)


def test_manifest_is_the_last_write_on_the_durable_tier(
    s3_server: S3Server, tmp_path: Path
) -> None:
    log = EventLog(_durable(s3_server))
    tiers = TieredStorage(LocalStorage(str(tmp_path / "fast")), log)
    options = ss.SaveOptions(
        threads=2, piece_bytes=2048, plan=ss.PlanOptions(max_file_bytes=16 << 10)
    )
    ss.async_save(training_state(width=64), tiers, options=options).wait()
    ops = [(op, path.rsplit("/", 2)[-2:]) for op, path in log.events]
    closes = [i for i, (op, _) in enumerate(ops) if op == "close"]
    marker = next(i for i, (op, p) in enumerate(ops) if op == "put" and p[0] == ".markers")
    assert len(closes) >= 3 and max(closes) < marker  # every shard is durable before the marker
    assert ops[-1][0] == "put" and ops[-1][1][-1] == MANIFEST
    assert [op for op, _ in ops].count("put") == 2  # the marker, then the manifest


def test_reads_prefer_the_fast_tier_and_fall_back_to_the_durable_one(
    s3_server: S3Server, tmp_path: Path
) -> None:
    durable = _durable(s3_server)
    state = training_state(seed=0)
    ss.save(state, TieredStorage(LocalStorage(str(tmp_path / "fast")), durable))
    counted = CountingStorage(durable)
    restored = training_state(seed=1)
    ss.load(restored, TieredStorage(LocalStorage(str(tmp_path / "fast")), counted))
    assert_same_state(state, restored)
    assert counted.data_reads == {} and counted.small_reads == {}  # nothing came from S3
    restored = training_state(seed=2)
    # empty fast tier
    ss.load(restored, TieredStorage(LocalStorage(str(tmp_path / "new-node")), counted))
    assert_same_state(state, restored)
    assert sum(counted.data_reads.values()) > 0


def test_failed_copy_fails_the_save_and_commits_nothing(
    s3_server: S3Server, tmp_path: Path
) -> None:
    durable = _durable(s3_server)
    log = EventLog(durable, fail_under=f"{durable.root}/bad/")
    tiers = TieredStorage(LocalStorage(str(tmp_path / "fast")), log)
    with pytest.raises(OSError, match="injected"):
        ss.save(training_state(), tiers.child("bad"))
    for tier in (tiers.fast.child("bad"), durable.child("bad"), tiers.child("bad")):
        assert not tier.exists(MANIFEST)
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.inspect(tiers.child("bad"))
    ss.save(training_state(), tiers.child("good"))  # the failure stays with its checkpoint
    assert ss.verify(durable.child("good")).ok


def test_manager_on_tiers_keeps_both_tiers_in_step(s3_server: S3Server, tmp_path: Path) -> None:
    durable = _durable(s3_server)
    fast = LocalStorage(str(tmp_path / "fast"))
    with ss.CheckpointManager(TieredStorage(fast, durable), keep_last=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    assert fast.listdir() == durable.listdir() == ["step-000000003"]
    with ss.CheckpointManager(durable) as mgr:  # a later job that has only the durable tier
        target = {"w": torch.zeros(4)}
        assert mgr.restore(target) == 3 and target["w"].tolist() == [3.0] * 4


def test_async_save_finishing_at_interpreter_exit_still_commits(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A job that exits right after async_save: the copies run while Python shuts down."""
    durable = _durable(s3_server)
    child = f"""
import torch, snapstate as ss
from snapstate.storage.fsspec import FsspecStorage
from snapstate.storage.local import LocalStorage
from snapstate.storage.tiers import TieredStorage
durable = FsspecStorage({durable.root!r}, endpoint_url={s3_server.endpoint!r})
ss.async_save({{"w": torch.arange(100000)}}, TieredStorage(LocalStorage({str(tmp_path / "fast")!r}), durable))
"""
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    target = {"w": torch.zeros(100000, dtype=torch.int64)}
    ss.load(target, durable)
    assert torch.equal(target["w"], torch.arange(100000))
