"""Disk full, permission denied and I/O errors during a save: the error surfaces (on ``wait()``
for the background part), the save's files are removed, the previous checkpoint is intact, and
the next save works once the fault is gone."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
import snapstate.api as api
from snapstate.storage.base import storage_for
from support.storages import PHASES, Fault, FaultyStorage

OPTIONS = ss.SaveOptions(piece_bytes=256 << 10, block_bytes=128 << 10)


def state_of(mib: float, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // 4 // 4
    return {"layers": [torch.randn(n, generator=gen) for _ in range(4)], "step": seed}


def blank_of(mib: float) -> dict[str, Any]:
    n = int(mib * (1 << 20)) // 4 // 4
    return {"layers": [torch.zeros(n) for _ in range(4)], "step": -1}


def assert_holds(path: Path, state: dict[str, Any], mib: float) -> None:
    ss.verify(path)
    target = blank_of(mib)
    ss.load(target, path)
    assert (
        all(torch.equal(a, b) for a, b in zip(target["layers"], state["layers"]))
        and target["step"] == state["step"]
    )


def assert_nothing_left(path: Path) -> None:
    """No shard, marker or temporary manifest remains, and readers see no checkpoint."""
    files = (
        [str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()] if path.exists() else []
    )
    assert not files, f"a failed save left files behind: {files}"
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(blank_of(1), path)


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A committed checkpoint that no later failure may touch."""
    state = state_of(1, seed=1)
    ss.save(state, tmp_path / "step-1", options=OPTIONS)
    return tmp_path / "step-1", state


def _save(mode: str, state: dict[str, Any], path: Path) -> None:
    """Save and wait; async errors of the background part surface on wait()."""
    if mode == "save":
        ss.save(state, path, options=OPTIONS)
        return
    handle = ss.async_save(state, path, options=OPTIONS)
    handle.wait()


# -- failure by name -----------------------------------------------------------------------------


@contextlib.contextmanager
def faulty(monkeypatch: pytest.MonkeyPatch, *faults: Fault) -> Iterator[None]:
    monkeypatch.setattr(
        api, "storage_for", lambda path, **kw: FaultyStorage(storage_for(path, **kw), *faults)
    )
    try:
        yield
    finally:
        monkeypatch.setattr(api, "storage_for", storage_for)


AFTER = {"write_data": 3}  # fail mid-file rather than on the first piece


@pytest.mark.parametrize("mode", ["async", "save"])
@pytest.mark.parametrize("phase", [p for p in PHASES if p != "remove_markers"])
def test_failure_at_phase(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    previous: tuple[Path, dict[str, Any]],
    phase: str,
    mode: str,
) -> None:
    fault = Fault(phase, after=AFTER.get(phase, 0), error=errno.EIO)
    target = tmp_path / "step-2"
    # An async save opens its files in the background too: every phase fails on wait().
    with faulty(monkeypatch, fault), pytest.raises(OSError, match="injected") as info:
        _save(mode, state_of(2, seed=2), target)
    assert info.value.errno == errno.EIO and fault.fired == 1
    assert_nothing_left(target)
    assert_holds(*previous, mib=1)
    state = state_of(2, seed=3)
    _save(mode, state, target)  # the fault is gone: the same path saves fine
    assert_holds(target, state, mib=2)


def test_failing_marker_cleanup_after_commit_still_commits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Once the manifest is in place the checkpoint is committed: removing the markers is tidying."""
    state = state_of(1, seed=4)
    with faulty(monkeypatch, Fault("remove_markers")):
        ss.async_save(state, tmp_path / "c", options=OPTIONS).wait()
    assert_holds(tmp_path / "c", state, mib=1)


def test_two_failures_in_one_save(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, previous: tuple[Path, dict[str, Any]]
) -> None:
    """The data write fails, then so does the cleanup's first step: the first error is reported."""
    target = tmp_path / "step-2"
    with (
        faulty(monkeypatch, Fault("write_data", after=1, error=errno.ENOSPC), Fault("sync_dir")),
        pytest.raises(OSError) as info,
    ):
        ss.async_save(state_of(2), target, options=OPTIONS).wait()
    assert info.value.errno == errno.ENOSPC
    assert_nothing_left(target)
    assert_holds(*previous, mib=1)


def test_unobserved_error_surfaces_on_next_save(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with faulty(monkeypatch, Fault("write_marker", error=errno.EACCES)):
        handle = ss.async_save(state_of(1), tmp_path / "a", options=OPTIONS)
        while not handle.done():
            handle.error  # noqa: B018 - poll without observing
    with pytest.raises(PermissionError):
        ss.async_save(state_of(1), tmp_path / "b", options=OPTIONS)  # the failure is not lost
    assert not (tmp_path / "b").exists()
    state = state_of(1, seed=5)
    ss.async_save(state, tmp_path / "b", options=OPTIONS).wait()  # reported once; now saving works
    assert_holds(tmp_path / "b", state, mib=1)
    assert_nothing_left(tmp_path / "a")


# -- OS-level faults (mocked system calls) -------------------------------------------------------


def _pwrite_fails_after(monkeypatch: pytest.MonkeyPatch, budget: int, code: int) -> dict[str, int]:
    """os.pwrite writes ``budget`` bytes in all, then fails with ``code`` (a disk filling up)."""
    real = os.pwrite
    left = {"bytes": budget}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        n = min(len(data), left["bytes"])
        if n == 0:
            raise OSError(code, os.strerror(code))
        left["bytes"] -= n
        return real(fd, memoryview(data)[:n], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return left


def _open_fails_for(monkeypatch: pytest.MonkeyPatch, fragment: str, code: int) -> None:
    real = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if fragment in os.fspath(path) and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def _fails_for(monkeypatch: pytest.MonkeyPatch, name: str, fragment: str, code: int) -> None:
    """os.<name>(fd or path, ...) fails when its file's path holds ``fragment``."""
    real = getattr(os, name)

    def call(first: Any, *args: Any, **kwargs: Any) -> Any:
        where = (
            os.readlink(f"/proc/self/fd/{first}") if isinstance(first, int) else os.fspath(first)
        )
        where += (
            " -> " + os.fspath(args[0]) if args and isinstance(args[0], (str, os.PathLike)) else ""
        )
        if fragment in where:
            raise OSError(code, os.strerror(code), where)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(os, name, call)


OS_FAULTS: dict[str, Callable[[pytest.MonkeyPatch], Any]] = {
    "enospc-pwrite": lambda mp: _pwrite_fails_after(mp, 600 << 10, errno.ENOSPC),
    "eio-pwrite": lambda mp: _pwrite_fails_after(mp, 64 << 10, errno.EIO),
    "eacces-marker": lambda mp: _open_fails_for(mp, "/.markers/", errno.EACCES),
    "eacces-manifest-temp": lambda mp: _open_fails_for(mp, "/.manifest.json.", errno.EACCES),
    "eio-fsync-shard": lambda mp: _fails_for(mp, "fsync", ".safetensors", errno.EIO),
    "enospc-fsync-manifest": lambda mp: _fails_for(mp, "fsync", ".manifest.json.", errno.ENOSPC),
    "eacces-rename-manifest": lambda mp: _fails_for(mp, "replace", "manifest.json", errno.EACCES),
}
EXPECTED = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}


@pytest.mark.parametrize("fault", list(OS_FAULTS))
def test_os_error_during_async_persist(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    previous: tuple[Path, dict[str, Any]],
    fault: str,
) -> None:
    target = tmp_path / "step-2"
    with monkeypatch.context() as mp:
        OS_FAULTS[fault](mp)
        # staging never touches the disk
        handle = ss.async_save(state_of(2, seed=2), target, options=OPTIONS)
        with pytest.raises(OSError) as info:
            handle.wait()
    assert info.value.errno == EXPECTED[fault.split("-")[0]]
    assert_nothing_left(target)
    assert_holds(*previous, mib=1)
    state = state_of(2, seed=3)
    ss.async_save(state, target, options=OPTIONS).wait()
    assert_holds(target, state, mib=2)


def test_manager_disk_full_then_space_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path, keep_last=2, async_save=True, options=OPTIONS) as mgr:
        first = state_of(1, seed=10)
        mgr.save(10, first)
        mgr.wait()
        with monkeypatch.context() as mp:
            _pwrite_fails_after(mp, 300 << 10, errno.ENOSPC)
            mgr.save(20, state_of(1, seed=20))
            with pytest.raises(OSError) as info:
                mgr.wait()
        assert info.value.errno == errno.ENOSPC
        assert mgr.steps() == [10]
        assert_nothing_left(Path(mgr.path(20)))
        third = state_of(1, seed=30)
        mgr.save(30, third)
        mgr.wait()
        assert mgr.steps() == [10, 30]
        restored = blank_of(1)
        assert mgr.restore(restored) == 30
    assert_holds(Path(mgr.path(10)), first, mib=1)
    assert_holds(Path(mgr.path(30)), third, mib=1)


# -- a real full file system ---------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, where mounting is allowed (root in a container that permits it)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("mode", ["async", "manager"])
def test_real_disk_full_on_tmpfs(small_tmpfs: Path, mode: str) -> None:
    first = state_of(2, seed=1)
    ss.save(first, small_tmpfs / "step-1", options=OPTIONS)
    too_big = state_of(7, seed=2)  # 2 + 7 MiB > 8 MiB
    if mode == "async":
        handle = ss.async_save(too_big, small_tmpfs / "step-2", options=OPTIONS)
        with pytest.raises(OSError) as info:
            handle.wait()
    else:
        with ss.CheckpointManager(small_tmpfs, async_save=True, options=OPTIONS) as mgr:
            mgr.save(2, too_big)
            with pytest.raises(OSError) as info:
                mgr.wait()
    assert info.value.errno == errno.ENOSPC
    assert_nothing_left(small_tmpfs / "step-2")
    assert_holds(small_tmpfs / "step-1", first, mib=2)
    fits = state_of(4, seed=3)  # the failed save's space is back: 2 + 4 MiB fit
    ss.async_save(fits, small_tmpfs / "step-3", options=OPTIONS).wait()
    assert_holds(small_tmpfs / "step-3", fits, mib=4)


# -- file descriptors and threads after a failure ------------------------------------------------


def _track_fds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record every os.close of a descriptor that os.open did not hand out (or that is closed already)."""
    real_open, real_close = os.open, os.close
    open_fds: set[int] = set()
    bad: list[int] = []

    def open_(*args: Any, **kwargs: Any) -> int:
        fd = real_open(*args, **kwargs)
        open_fds.add(fd)
        return fd

    def close(fd: int) -> None:
        if fd in open_fds:
            open_fds.discard(fd)
        else:
            bad.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    return bad


def _persist_threads() -> list[str]:
    import threading

    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("snapstate-persist", "snapstate-hash"))
    ]


@pytest.mark.parametrize("fault", ["eio-fsync-shard", "enospc-pwrite"])
def test_failed_persist_closes_each_file_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fault: str
) -> None:
    """A second close of a descriptor number could close a file someone else opened since."""
    with monkeypatch.context() as mp:
        double_closes = _track_fds(mp)
        OS_FAULTS[fault](mp)
        with pytest.raises(OSError):
            ss.async_save(state_of(2), tmp_path / "c", options=OPTIONS).wait()
    assert not double_closes, f"descriptors closed twice: {double_closes}"
    assert_nothing_left(tmp_path / "c")


def test_failure_while_staging_streams(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, previous: tuple[Path, dict[str, Any]]
) -> None:
    """With a pool smaller than the state, writes run during staging; a full disk then stops
    the save inside async_save or on wait(), and no writer thread outlives it."""
    pool = ss.HostBufferPool(budget_bytes=512 << 10, slab_bytes=256 << 10)
    target = tmp_path / "step-2"
    with monkeypatch.context() as mp:
        double_closes = _track_fds(mp)
        _pwrite_fails_after(mp, 700 << 10, errno.ENOSPC)
        with pytest.raises(OSError) as info:
            ss.async_save(state_of(4), target, options=OPTIONS, pool=pool).wait()
    assert info.value.errno == errno.ENOSPC
    assert not double_closes
    assert_nothing_left(target)
    assert not _persist_threads(), _persist_threads()
    assert_holds(*previous, mib=1)
    state = state_of(4, seed=9)
    ss.async_save(state, target, options=OPTIONS, pool=pool).wait()  # the pool is whole again
    assert_holds(target, state, mib=4)
