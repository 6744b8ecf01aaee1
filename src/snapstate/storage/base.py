"""The storage Protocol every backend implements, and the choice of backend for a path."""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable


def defines_with(obj: object, name: str, base: str) -> bool:
    """Whether ``obj``'s class defines ``name`` in the same class as ``base``.

    A backend's faster path (``open_reader``, ``write_many``, ``map_file``) is taken only then:
    a wrapper (delegating ``__getattr__``) or a subclass that changes ``base`` (to count or to
    inject faults) must see every call go through ``base``.
    """
    owners = [next((c for c in type(obj).__mro__ if n in vars(c)), None) for n in (name, base)]
    return owners[0] is not None and owners[0] is owners[1]


@runtime_checkable
class FileWriter(Protocol):
    """A file being written; ``write_at`` may need increasing offsets on sequential stores."""

    sequential: bool

    def write_at(self, data: memoryview, offset: int) -> None: ...

    def close(self, sync: bool = True) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """A checkpoint directory; every path is relative to it and uses '/'."""

    root: str

    def open_writer(self, path: str, size: int) -> FileWriter: ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None: ...

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...

    def size(self, path: str) -> int: ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str = "") -> list[str]: ...

    def write_atomic(self, path: str, data: bytes) -> None: ...

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str = "") -> None: ...

    def makedirs(self, path: str = "") -> None: ...

    def sync_dir(self, path: str = "") -> None: ...

    def child(self, path: str) -> Storage: ...


@runtime_checkable
class CreatesNew(Protocol):
    """A store that can publish a file only if its name is free, atomically (the lock)."""

    def create_new(self, path: str, data: bytes) -> None:
        """Write ``path`` whole unless it exists: FileExistsError if it does;
        NotImplementedError where this store cannot tell (the caller falls back)."""
        ...


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def storage_for(path: str | os.PathLike[str] | Storage, **options: Any) -> Storage:
    """LocalStorage for plain paths, FsspecStorage for URLs such as ``s3://bucket/run``.

    A Storage object is used as it is, so one (an FsspecStorage with storage options, a
    TieredStorage) can be passed wherever the API takes a path.
    """
    if not isinstance(path, (str, os.PathLike)):
        if options:
            raise TypeError("storage options go to the Storage object's constructor, not with it")
        return path
    text = os.fspath(path)
    if is_url(text):
        from snapstate.storage.fsspec import FsspecStorage

        return FsspecStorage(text, **options)
    from snapstate.storage.local import LocalStorage

    return LocalStorage(text.removeprefix("file://"))
