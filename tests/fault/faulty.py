"""FaultyStorage: a Storage wrapper that fails chosen phases of a save, by name (after DCP's
FaultyStorageWriter), so that each failure path is tested on purpose rather than by luck."""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from snapstate.storage.base import FileWriter, Storage

# The phases a save goes through, in order, as FaultyStorage names them.
PHASES = (
    "open_writer",
    "write_header",
    "write_data",
    "close",
    "sync_dir",
    "write_marker",
    "write_manifest",
    "remove_markers",
)


@dataclass
class Fault:
    """Fail the ``phase`` with ``error`` once it has succeeded ``after`` times."""

    phase: str
    after: int = 0
    error: int = errno.EIO
    calls: int = 0
    fired: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self, phase: str, what: str) -> None:
        if phase != self.phase:
            return
        with self.lock:
            self.calls += 1
            if self.calls <= self.after:
                return
            self.fired += 1
        raise OSError(self.error, f"{os.strerror(self.error)} (injected in {phase})", what)


class FaultyWriter:
    """Wraps a FileWriter; the first write of a shard is its header."""

    def __init__(self, inner: FileWriter, path: str, faults: list[Fault]) -> None:
        self.inner, self.path, self.faults = inner, path, faults
        self.sequential = inner.sequential
        self._writes = 0

    def write_at(self, data: memoryview, offset: int) -> None:
        phase = "write_header" if offset == 0 else "write_data"
        for f in self.faults:
            f.check(phase, self.path)
        self.inner.write_at(data, offset)

    def close(self, sync: bool = True) -> None:
        for f in self.faults:
            f.check("close", self.path)
        self.inner.close(sync)

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage:
    """Delegates to ``inner``; each ``Fault`` fails its phase."""

    def __init__(self, inner: Storage, *faults: Fault) -> None:
        self.inner = inner
        self.faults = list(faults)
        self.root = inner.root

    def _check(self, phase: str, what: str) -> None:
        for f in self.faults:
            f.check(phase, what)

    def open_writer(self, path: str, size: int) -> FileWriter:
        self._check("open_writer", path)
        return FaultyWriter(self.inner.open_writer(path, size), path, self.faults)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._check(
            "write_manifest"
            if path == "manifest.json"
            else "write_marker"
            if path.startswith(".markers/")
            else "write_atomic",
            path,
        )
        self.inner.write_atomic(path, data)

    def sync_dir(self, path: str = "") -> None:
        self._check("sync_dir", path)
        self.inner.sync_dir(path)

    def remove_tree(self, path: str = "") -> None:
        if path == ".markers" and self.inner.exists(
            "manifest.json"
        ):  # the tidying after the commit
            self._check("remove_markers", path)
        self.inner.remove_tree(path)

    def child(self, path: str) -> Storage:
        return FaultyStorage(self.inner.child(path), *self.faults)

    def __getattr__(self, name: str) -> Any:  # reads, sizes, listings: untouched
        return getattr(self.inner, name)


def fired(faults: list[Fault]) -> int:
    return sum(f.fired for f in faults)
