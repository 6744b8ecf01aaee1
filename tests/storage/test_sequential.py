"""The engine's persist path writes every shard file front to back, as object stores need."""

from __future__ import annotations

import threading

import pytest
import torch

import snapstate as ss
from snapstate.storage.base import FileWriter, Storage
from snapstate.storage.local import LocalStorage
from support.storages import Delegating


class _RecordingWriter:
    sequential = True

    def __init__(self, inner: FileWriter, log: list[tuple[int, int]], lock: threading.Lock) -> None:
        self.inner, self.log, self.lock = inner, log, lock

    def write_at(self, data: memoryview, offset: int) -> None:
        with self.lock:
            self.log.append((offset, len(data)))
        self.inner.write_at(data, offset)

    def close(self, sync: bool = True) -> None:
        self.inner.close(sync)

    def abort(self) -> None:
        self.inner.abort()


class RecordingStorage(Delegating):
    """Logs every (offset, length) written, per file, in the order the writes happened."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.writes: dict[str, list[tuple[int, int]]] = {}

    def open_writer(self, path: str, size: int) -> FileWriter:
        log = self.writes.setdefault(path, [])
        return _RecordingWriter(self.inner.open_writer(path, size), log, self.lock)


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 257, generator=gen),
        "half": torch.randn(64, 33, generator=gen).half(),
        "ints": torch.randint(0, 9, (1000,), generator=gen),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.0),
        "flags": torch.ones(17, dtype=torch.bool),
    }


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_every_file_is_written_in_order_without_gaps(tmp_path, mode: str) -> None:
    storage = RecordingStorage(LocalStorage(str(tmp_path / "ckpt")))
    options = ss.SaveOptions(
        threads=3, piece_bytes=4096, plan=ss.PlanOptions(max_file_bytes=64 << 10)
    )
    state = _state()
    if mode == "blocking":
        ss.save(state, storage, options=options)
    else:
        ss.async_save(
            state,
            storage,
            options=options,
            pool=ss.HostBufferPool(budget_bytes=1 << 20, slab_bytes=64 << 10),
        ).wait()
    shards = {p: w for p, w in storage.writes.items() if p.startswith("shards/")}
    assert len(shards) >= 3
    for path, writes in shards.items():
        position = 0
        for offset, length in writes:
            assert offset == position, f"{path}: write at {offset}, file ends at {position}"
            position += length
        assert position == storage.inner.size(path)
        assert len(writes) > 2  # header and several pieces: the order was really exercised
