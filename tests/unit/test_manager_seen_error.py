"""A background save error is reported exactly once: an error the caller already saw on
``handle.wait()`` is not raised again by the manager's next save, and that save is made."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import snapstate as ss
from support.procs import wait_for

from .test_async import fail_with_enospc


def _state() -> dict[str, torch.Tensor]:
    return {"x": torch.arange(100, dtype=torch.float32)}


def test_error_seen_on_wait_is_not_raised_again_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = ss.CheckpointManager(tmp_path, async_save=True)
    fail_with_enospc(monkeypatch)
    handle = mgr.save(1, _state())
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    mgr.save(2, _state())  # must neither raise step 1's error again nor skip step 2
    mgr.wait()
    assert mgr.steps() == [2]
    assert ss.verify(mgr.path(2)).ok
    mgr.close()


def test_unseen_error_is_raised_once_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = ss.CheckpointManager(tmp_path, async_save=True)
    fail_with_enospc(monkeypatch)
    handle = mgr.save(1, _state())
    wait_for(handle.done, 30, "the failing background save")
    monkeypatch.undo()
    with pytest.raises(OSError):
        mgr.save(2, _state())  # nobody saw step 1 fail: this save reports it
    mgr.save(3, _state())  # reported once: the next save works
    mgr.wait()
    assert mgr.steps() == [3]
    mgr.close()
