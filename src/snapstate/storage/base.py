"""The storage Protocol every backend implements, its optional capabilities, and the backend
for a path.

A backend is any object with the methods of ``Storage`` (and writers with those of
``FileWriter``); nothing is inherited. Beyond them a backend may offer faster or safer ways,
each a small Protocol of its own:

- ``MappableFiles`` (``map_file``): the mapped load verifies every byte, then copies from the
  mapping (``engine/mapped.py``);
- ``FileReaders`` (``open_reader``): one open file for many positional reads, in file order
  (``engine/readorder.py``); a reader that is a ``VectoredReader`` (``read_many``) fills
  nearby chunks in one call;
- ``VectoredWriter`` (``write_many`` on a writer): runs of small chunks in one write
  (``engine/persist.py``);
- ``PageCacheProbe`` (``cached``): whether shards are in the page cache (``engine/load.py``
  chooses how to keep a rollback copy);
- ``LinkCheck`` (``leaves_root``): a shard that resolves outside the checkpoint is refused;
- ``RegularFileReads`` (``read_regular``): the manifest is read only from a regular file;
- ``Renames`` (``rename``): a damaged step is set aside by one rename (``manager.py``).

A backend declares what it offers: its class defines ``capabilities(self) -> Capabilities``,
one frozen value whose fields are the backend itself, typed as each capability, or None.
``capabilities(storage)`` (and ``vectored_writer(writer)``) is the one place the engine asks,
and it calls the typed handles it gets back. The method is looked up on the class, so a
wrapper that delegates through ``__getattr__`` offers only what it declares itself; a
backend offers a fast path past ``read_into`` only while that is its own (``LocalStorage``: a
subclass that overrides ``read_into`` to count reads or inject faults sees every read).

A minimal third-party backend, here one that keeps files in a dict, has none of them and
works wherever a path does:

>>> import torch, snapstate as ss
>>> class DictWriter:
...     sequential = False
...     def __init__(self, files, key, size):
...         self.files, self.key, self.data = files, key, bytearray(size)
...     def write_at(self, data, offset):
...         self.data[offset : offset + len(data)] = data
...     def close(self, sync=True):
...         self.files[self.key] = bytes(self.data)
...     def abort(self):
...         pass
>>> class DictStorage:
...     def __init__(self, files=None, root="dict:"):
...         self.files, self.root = {} if files is None else files, root
...     def _key(self, path):
...         return f"{self.root}/{path}" if path else self.root
...     def _file(self, path):
...         if self._key(path) not in self.files:
...             raise FileNotFoundError(self._key(path))
...         return self.files[self._key(path)]
...     def open_writer(self, path, size):
...         return DictWriter(self.files, self._key(path), size)
...     def read_into(self, path, offset, out):
...         data = self._file(path)[offset : offset + len(out)]
...         if len(data) < len(out):
...             raise EOFError(f"{self._key(path)} ends before byte {offset + len(out)}")
...         out[:] = data
...     def read_bytes(self, path, offset=0, length=None):
...         data = self._file(path)[offset:]
...         return data if length is None else data[:length]
...     def size(self, path):
...         return len(self._file(path))
...     def exists(self, path):
...         key = self._key(path)
...         return key in self.files or any(k.startswith(key + "/") for k in self.files)
...     def listdir(self, path=""):
...         prefix = self._key(path) + "/"
...         return sorted({k[len(prefix):].split("/")[0] for k in self.files if k.startswith(prefix)})
...     def write_atomic(self, path, data):
...         self.files[self._key(path)] = bytes(data)
...     def remove(self, path):
...         self.files.pop(self._key(path), None)
...     def remove_tree(self, path=""):
...         key = self._key(path)
...         for k in [k for k in self.files if k == key or k.startswith(key + "/")]:
...             del self.files[k]
...     def makedirs(self, path=""):
...         pass
...     def sync_dir(self, path=""):
...         pass
...     def child(self, path):
...         return DictStorage(self.files, self._key(path))
>>> storage = DictStorage()
>>> isinstance(storage, Storage), capabilities(storage) == Capabilities()
(True, True)
>>> _ = ss.save({"w": torch.arange(6.0)}, storage)
>>> target = {"w": torch.zeros(6)}
>>> ss.load(target, storage).bytes_read, target["w"].tolist()
(24, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])

A backend with a capability declares it, here one open reader per file:

>>> class DictReader:
...     def __init__(self, data):
...         self.data = data
...     def read_into(self, offset, out):
...         out[:] = self.data[offset : offset + len(out)]
...     def close(self):
...         pass
>>> class ReaderDictStorage(DictStorage):
...     def open_reader(self, path):
...         return DictReader(self._file(path))
...     def capabilities(self):
...         return Capabilities(file_readers=self)
>>> fast = ReaderDictStorage(storage.files)
>>> capabilities(fast).file_readers is fast
True
>>> target = {"w": torch.zeros(6)}
>>> ss.load(target, fast).bytes_read, target["w"].tolist()
(24, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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


class FileReader(Protocol):
    """One open file for positional reads (what ``FileReaders.open_reader`` returns)."""

    def read_into(self, offset: int, out: memoryview) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class VectoredReader(Protocol):
    """A FileReader that fills several buffers from consecutive bytes in one call."""

    def read_many(self, offset: int, buffers: list[memoryview]) -> None: ...


@runtime_checkable
class VectoredWriter(Protocol):
    """A FileWriter that writes buffers back to back in one call; returns the bytes written."""

    def write_many(self, buffers: tuple[memoryview, ...], offset: int) -> int: ...


@runtime_checkable
class MappableFiles(Protocol):
    """Files mapped into memory, private and writable (no write reaches the file); a missing
    file raises FileNotFoundError, an empty one EOFError."""

    def map_file(self, path: str) -> mmap.mmap: ...


@runtime_checkable
class FileReaders(Protocol):
    """One open file for many positional reads (the kernel's readahead follows them)."""

    def open_reader(self, path: str) -> FileReader: ...


@runtime_checkable
class PageCacheProbe(Protocol):
    """Whether a file's pages at ``offsets`` are cached; True where the system cannot tell."""

    def cached(self, path: str, offsets: list[int]) -> bool: ...


@runtime_checkable
class LinkCheck(Protocol):
    """Whether ``path`` resolves (through symlinks) to a place outside the root."""

    def leaves_root(self, path: str) -> bool: ...


@runtime_checkable
class RegularFileReads(Protocol):
    """A regular file's bytes, at most ``cap`` (``cap + 1`` to detect more); anything else
    (a symlink, a FIFO, a device) is an OSError(EINVAL)."""

    def read_regular(self, path: str, cap: int) -> bytes: ...


@runtime_checkable
class Renames(Protocol):
    """One atomic rename within the root."""

    def rename(self, src: str, dst: str) -> None: ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond ``Storage``: each field the backend itself, typed as the
    capability, or None."""

    mappable: MappableFiles | None = None
    file_readers: FileReaders | None = None
    page_cache: PageCacheProbe | None = None
    link_check: LinkCheck | None = None
    regular_reads: RegularFileReads | None = None
    renames: Renames | None = None
    creates_new: CreatesNew | None = None


NONE = Capabilities()


def capabilities(storage: Storage) -> Capabilities:
    """What ``storage`` declares it offers: its class's ``capabilities()`` method, else none.

    The method is looked up on the class, not the instance: a wrapper that delegates through
    ``__getattr__`` offers only what it declares itself, so no fast path bypasses its
    ``read_into``.
    """
    declared = getattr(type(storage), "capabilities", None)
    if declared is None:
        return NONE
    answer: object = declared(storage)
    if not isinstance(answer, Capabilities):
        raise TypeError(f"{type(storage).__name__}.capabilities() returned {answer!r}")
    return answer


def vectored_writer(writer: FileWriter) -> VectoredWriter | None:
    """The writer itself where its class declares ``write_many`` (a wrapper that only forwards
    ``write_at`` sees every write)."""
    if getattr(type(writer), "write_many", None) is not None and isinstance(writer, VectoredWriter):
        return writer
    return None


def read_capped(storage: Storage, path: str, cap: int) -> bytes:
    """A small file's bytes, at most one past ``cap``: only from a regular file where the
    backend can tell (``RegularFileReads``: no FIFO that blocks, no /dev/zero that never ends)."""
    regular = capabilities(storage).regular_reads
    if regular is not None:
        return regular.read_regular(path, cap)
    return storage.read_bytes(path, 0, cap + 1)


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
