"""Whole-chunk reads shard by shard, in file order, through one open file; checksums meanwhile.

Why: opening the shard again for every chunk restarts the kernel's readahead at each chunk,
so the disk idles while the first window of every chunk arrives. On the 2-core CI machine
(cold cache, 16 chunks of 32 MiB) that cost about 20 % against one plain sequential read of
the same bytes. Reading each shard front to back through one open file streams like that
plain read, and verifying a chunk on another thread overlaps its hashing with the next read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from snapstate.errors import CorruptCheckpointError
from snapstate.storage.base import Storage


class FileReader(Protocol):
    def read_into(self, offset: int, out: memoryview) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DirectRead:
    """Bytes ``[offset, offset + len(out))`` of ``file`` straight into ``out``, then ``check()``."""

    file: str
    offset: int
    out: memoryview
    key: str
    check: Callable[[], None]


class _PerCallReader:
    """For backends without ``open_reader``: each read is one ``read_into`` call."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path

    def read_into(self, offset: int, out: memoryview) -> None:
        self.storage.read_into(self.path, offset, out)

    def close(self) -> None:
        pass


def open_reader(storage: Storage, path: str) -> FileReader:
    """The backend's own reader, only where it comes with the class's ``read_into``.

    A wrapper (delegating ``__getattr__``) or a subclass that changes ``read_into`` (to count
    or to inject faults) must see every read, so it gets reads through ``read_into``.
    """
    cls = type(storage)
    owner = _defined_in(cls, "open_reader")
    if owner is not None and owner is _defined_in(cls, "read_into"):
        backend: Any = storage
        return backend.open_reader(path)  # type: ignore[no-any-return]
    return _PerCallReader(storage, path)


def _defined_in(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def read_in_file_order(storage: Storage, reads: list[DirectRead], threads: int) -> int:
    """Do ``reads``, one thread per shard (at most ``threads``); returns the bytes read."""
    by_file: dict[str, list[DirectRead]] = defaultdict(list)
    for r in reads:
        by_file[r.file].append(r)
    if threads <= 1:
        return sum(_read_file(storage, file, rs, None) for file, rs in by_file.items())
    readers = max(1, min(threads, len(by_file)))
    with (
        ThreadPoolExecutor(
            max(1, threads - readers), thread_name_prefix="snapstate-verify"
        ) as checkers,
        ThreadPoolExecutor(readers, thread_name_prefix="snapstate-read") as pool,
    ):
        return sum(
            pool.map(lambda item: _read_file(storage, item[0], item[1], checkers), by_file.items())
        )


def _read_file(
    storage: Storage, file: str, reads: list[DirectRead], checkers: ThreadPoolExecutor | None
) -> int:
    checks: list[Future[None]] = []
    try:
        reader = open_reader(storage, file)
    except FileNotFoundError:
        raise CorruptCheckpointError("shard file is missing", file=file, key=reads[0].key) from None
    try:
        for r in sorted(reads, key=lambda r: r.offset):
            _read_one(reader, r)
            if checkers is None:
                r.check()
            else:
                checks.append(checkers.submit(r.check))
    finally:
        reader.close()
        failures = [c.exception() for c in checks]  # every check has ended before we return
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        raise first
    return sum(len(r.out) for r in reads)


def _read_one(reader: FileReader, r: DirectRead) -> None:
    try:
        reader.read_into(r.offset, r.out)
    except FileNotFoundError:
        raise CorruptCheckpointError("shard file is missing", file=r.file, key=r.key) from None
    except EOFError as exc:
        raise CorruptCheckpointError(
            f"shard file is truncated: {exc}", file=r.file, key=r.key
        ) from None
