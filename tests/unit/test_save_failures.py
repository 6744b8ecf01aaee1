"""Saves that must fail cleanly: the root deleted mid-save, the OS refusing writes, and the
plan cache shared by saves on two threads at once."""

from __future__ import annotations

import errno
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
import snapstate.engine.save as save_mod
from snapstate.collective.coordinator import LocalCoordinator
from snapstate.engine.options import SaveOptions
from snapstate.engine.persist import RankWriter
from snapstate.engine.save import start_save
from snapstate.storage.local import LocalFileWriter, LocalStorage


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=gen), "b": torch.randn(64, generator=gen)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("when", ["before_fsync", "after_marker"])
def test_root_deleted_during_async_save_fails_the_save(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, when: str
) -> None:
    root = tmp_path / "ckpt"
    if when == "before_fsync":
        open_files = RankWriter._open_files

        def deleting_open(self: RankWriter) -> None:
            open_files(self)
            shutil.rmtree(root)  # the writes to come go to files that are now unlinked

        monkeypatch.setattr(RankWriter, "_open_files", deleting_open)
    else:
        write_marker = save_mod.write_marker

        def deleting_write_marker(storage: Any, *args: Any) -> None:
            write_marker(storage, *args)
            shutil.rmtree(root / "shards")

        monkeypatch.setattr(save_mod, "write_marker", deleting_write_marker)
    handle = ss.async_save(_state(), root)
    with pytest.raises(ss.CheckpointError):
        handle.wait()
    assert not (root / "manifest.json").exists()
    monkeypatch.undo()
    state = _state(1)
    ss.save(state, root)  # the same path saves fine afterwards
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ss.load(target, root)
    assert _equal(target, state)


@pytest.mark.parametrize("mode", ["save", "async"])
@pytest.mark.parametrize(
    ("code", "kind"),
    [(errno.ENOSPC, OSError), (errno.EROFS, OSError), (errno.EACCES, PermissionError)],
)
def test_os_error_in_persist_is_a_checkpoint_error_with_errno_and_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str, code: int, kind: type
) -> None:
    def refusing_write(self: LocalFileWriter, data: memoryview, offset: int) -> None:
        raise OSError(code, "refused by the test", self.full_path)

    monkeypatch.setattr(LocalFileWriter, "write_at", refusing_write)
    root = tmp_path / "ckpt"
    with pytest.raises(ss.CheckpointError) as info:
        if mode == "save":
            ss.save(_state(), root)
        else:
            ss.async_save(_state(), root).wait()
    err = info.value
    assert isinstance(err, ss.CheckpointIOError) and isinstance(err, kind)
    assert err.errno == code
    assert err.filename is not None and str(root) in err.filename
    assert "refused by the test" in str(err) and str(root) in str(err)
    assert not (root / "manifest.json").exists()


def test_plan_cache_shared_by_two_threads_saving_at_once(tmp_path: Path) -> None:
    """Two structures saved concurrently through one coordinator: each save uses its own plan."""
    coord = LocalCoordinator()
    states = [
        {"a": torch.arange(100.0), "n": torch.arange(7)},
        {"x": torch.ones(3, 5, dtype=torch.float64), "y": torch.arange(50, dtype=torch.int16)},
    ]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def saver(i: int) -> None:
        start.wait()
        try:
            for n in range(25):
                storage = LocalStorage(str(tmp_path / f"t{i}-{n}"))
                start_save(
                    states[i], storage, coord, pool=None, step=n, options=SaveOptions()
                ).wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, state in enumerate(states):
        for n in range(25):
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            ss.load(target, tmp_path / f"t{i}-{n}")
            assert _equal(target, state)
