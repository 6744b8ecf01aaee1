"""Two third-party backends on local files, as an outside author would write them.

``MinimalStorage`` has the Storage Protocol's methods and nothing else: every optional
capability (storage/base.py) is absent, so the engine takes its plain paths. ``FullStorage``
adds every one and declares them in its ``capabilities()``.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import shutil
import stat

from snapstate.storage.base import Capabilities, FileReader


class MinimalWriter:
    sequential = False

    def __init__(self, full: str) -> None:
        self.full = full
        self.fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_at(self, data: memoryview, offset: int) -> None:
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def close(self, sync: bool = True) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            if sync:
                os.fsync(fd)
            os.close(fd)

    def abort(self) -> None:
        self.close(sync=False)
        if os.path.exists(self.full):
            os.unlink(self.full)


class MinimalStorage:
    """The Storage Protocol on a directory, with plain file calls only."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def open_writer(self, path: str, size: int) -> MinimalWriter:
        os.makedirs(os.path.dirname(self._full(path)), exist_ok=True)
        return MinimalWriter(self._full(path))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        with open(self._full(path), "rb", buffering=0) as f:
            f.seek(offset)
            got = 0
            while got < len(out):
                n = f.readinto(out[got:])
                if not n:
                    raise EOFError(f"{path}: ends at byte {offset + got}")
                got += n

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self._full(path), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def size(self, path: str) -> int:
        return os.stat(self._full(path)).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def listdir(self, path: str = "") -> list[str]:
        full = self._full(path)
        return sorted(os.listdir(full)) if os.path.isdir(full) else []

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(full + ".tmp", full)

    def remove(self, path: str) -> None:
        if os.path.isfile(self._full(path)):
            os.unlink(self._full(path))

    def remove_tree(self, path: str = "") -> None:
        shutil.rmtree(self._full(path), ignore_errors=True)

    def makedirs(self, path: str = "") -> None:
        os.makedirs(self._full(path), exist_ok=True)

    def sync_dir(self, path: str = "") -> None:
        fd = os.open(self._full(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def child(self, path: str) -> MinimalStorage:
        return type(self)(self._full(path))


class FullWriter(MinimalWriter):
    def write_many(self, buffers: tuple[memoryview, ...], offset: int) -> int:
        for buffer in buffers:
            self.write_at(buffer, offset)
            offset += len(buffer)
        return sum(len(b) for b in buffers)


class FullReader:
    def __init__(self, full: str) -> None:
        self.fd = os.open(full, os.O_RDONLY)

    def read_into(self, offset: int, out: memoryview) -> None:
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], offset + got)
            if not n:
                raise EOFError(f"ends at byte {offset + got}")
            got += n

    def read_many(self, offset: int, buffers: list[memoryview]) -> None:
        for buffer in buffers:
            self.read_into(offset, buffer)
            offset += len(buffer)

    def close(self) -> None:
        os.close(self.fd)


class FullStorage(MinimalStorage):
    """Every optional capability of storage/base.py."""

    def capabilities(self) -> Capabilities:
        return Capabilities(**{f.name: self for f in dataclasses.fields(Capabilities)})

    def open_writer(self, path: str, size: int) -> FullWriter:
        os.makedirs(os.path.dirname(self._full(path)), exist_ok=True)
        return FullWriter(self._full(path))

    def map_file(self, path: str) -> mmap.mmap:
        with open(self._full(path), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise EOFError(f"{path}: file is empty")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def open_reader(self, path: str) -> FileReader:
        return FullReader(self._full(path))

    def cached(self, path: str, offsets: list[int]) -> bool:
        return True  # cannot tell: the mapped load stays

    def leaves_root(self, path: str) -> bool:
        root = os.path.realpath(self.root)
        return os.path.commonpath([root, os.path.realpath(self._full(path))]) != root

    def read_regular(self, path: str, cap: int) -> bytes:
        fd = os.open(self._full(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(cap + 1)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self._full(src), self._full(dst))

    def create_new(self, path: str, data: bytes) -> None:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "xb") as f:  # FileExistsError when the name is taken
            f.write(data)
