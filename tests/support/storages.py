"""Storage wrappers for tests: a delegating base, one that counts reads, one that fails on purpose.

FaultyStorage fails chosen phases of a save, by name (after DCP's FaultyStorageWriter), so that
each failure path is tested on purpose rather than by luck.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from snapstate.storage.base import Capabilities, FileWriter, Storage, capabilities

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


class Delegating:
    """A Storage that forwards everything to ``inner``; subclasses override what they watch."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.root = inner.root

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def capabilities(self) -> Capabilities:
        """Only the inner backend's link check: a fast path would bypass what a subclass
        watches (``read_into``, the writers)."""
        return Capabilities(link_check=capabilities(self.inner).link_check)


class CountingStorage(Delegating):
    """Counts the bytes read, per file, by ``read_into`` (tensor data) and ``read_bytes``."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.data_reads: dict[str, int] = {}
        self.small_reads: dict[str, int] = {}

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)
        with self.lock:
            self.data_reads[path] = self.data_reads.get(path, 0) + len(out)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        with self.lock:
            self.small_reads[path] = self.small_reads.get(path, 0) + len(data)
        return data

    def child(self, path: str) -> CountingStorage:
        return CountingStorage(self.inner.child(path))


@dataclass
class Fault:
    """Fail the ``phase`` with ``error`` once it has succeeded ``after`` times.

    With ``after_bytes``, a write only counts once it reaches past that byte of its file (a
    device lost mid-file: a torn shard).
    """

    phase: str
    after: int = 0
    error: int = errno.EIO
    after_bytes: int | None = None
    calls: int = 0
    fired: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self, phase: str, what: str, end: int = 0) -> None:
        if phase != self.phase or (self.after_bytes is not None and end <= self.after_bytes):
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

    def write_at(self, data: memoryview, offset: int) -> None:
        phase = "write_header" if offset == 0 else "write_data"
        for f in self.faults:
            f.check(phase, self.path, offset + len(data))
        self.inner.write_at(data, offset)

    def close(self, sync: bool = True) -> None:
        for f in self.faults:
            f.check("close", self.path)
        self.inner.close(sync)

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage(Delegating):
    """Delegates to ``inner``; each ``Fault`` fails its phase. Reads are untouched."""

    def __init__(self, inner: Storage, *faults: Fault) -> None:
        super().__init__(inner)
        self.faults = list(faults)

    def _check(self, phase: str, what: str) -> None:
        for f in self.faults:
            f.check(phase, what)

    def open_writer(self, path: str, size: int) -> FileWriter:
        self._check("open_writer", path)
        return FaultyWriter(self.inner.open_writer(path, size), path, self.faults)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._check(_atomic_phase(path), path)
        self.inner.write_atomic(path, data)

    def sync_dir(self, path: str = "") -> None:
        self._check("sync_dir", path)
        self.inner.sync_dir(path)

    def remove_tree(self, path: str = "") -> None:
        # Removing the markers of a committed checkpoint is the tidying after the commit.
        if path == ".markers" and self.inner.exists("manifest.json"):
            self._check("remove_markers", path)
        self.inner.remove_tree(path)

    def child(self, path: str) -> Storage:
        return FaultyStorage(self.inner.child(path), *self.faults)


def _atomic_phase(path: str) -> str:
    if path == "manifest.json":
        return "write_manifest"
    return "write_marker" if path.startswith(".markers/") else "write_atomic"


def fired(faults: list[Fault]) -> int:
    return sum(f.fired for f in faults)
