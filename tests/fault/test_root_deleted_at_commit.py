"""Issue 31 item 9: the root deleted between the shard check and the manifest never commits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.format.manifest import MANIFEST
from snapstate.storage.local import LocalStorage
from support.storages import Delegating


class DeletesRootBeforeManifest(Delegating):
    """Really removes the checkpoint directory just before the manifest is written: the
    moment after the shards were checked, where a user's ``rm -rf`` can still land."""

    def write_atomic(self, path: str, data: bytes) -> None:
        if path == MANIFEST:
            shutil.rmtree(self.inner.root)
        self.inner.write_atomic(path, data)


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_root_deleted_before_the_manifest_is_no_success(tmp_path: Path, use_async: bool) -> None:
    ckpt = tmp_path / "ckpt"
    storage = DeletesRootBeforeManifest(LocalStorage(str(ckpt)))
    state = {"w": torch.arange(1024.0), "epoch": 2}
    with pytest.raises(ss.CheckpointError, match="deleted"):
        if use_async:
            ss.async_save(state, storage).wait()  # type: ignore[arg-type]
        else:
            ss.save(state, storage)  # type: ignore[arg-type]
    assert not (ckpt / MANIFEST).exists(), "no manifest without its shards"
