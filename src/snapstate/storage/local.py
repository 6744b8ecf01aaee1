"""Local and parallel file systems: positional writes from many threads, fsync, atomic rename."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import sys
from collections.abc import Callable

from snapstate.storage.atomic import create_new_local, write_atomic_local
from snapstate.storage.base import Capabilities
from snapstate.storage.buffers import DIRECT_ALIGN as DIRECT_ALIGN
from snapstate.storage.buffers import buffer_address as buffer_address

WRITEBACK_MIN_BYTES = 1 << 20  # smaller writes are left to the kernel's own writeback
IOV_MAX = 1024  # buffers per vectored write (Linux's limit)
DIRECT_MIN_BYTES = 1 << 20  # a smaller write is not worth a second descriptor
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)


def _writeback_starter() -> Callable[[int, int, int], None] | None:
    """Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writing a range, do not wait.

    Why: the kernel otherwise holds a checkpoint's pages dirty until the final fsync, so the
    disk idles while the bytes are copied and hashed and then does all the work at the end.
    Durability still comes from that fsync; this only starts the disk earlier.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(
            ctypes.util.find_library("c") or "libc.so.6", use_errno=True
        ).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure here is caught by fsync

    return start


_start_writeback = _writeback_starter()


def direct_span(address: int, offset: int, nbytes: int) -> tuple[int, int] | None:
    """The part ``[begin, end)`` of a write of ``nbytes`` from ``address`` to file ``offset``
    that O_DIRECT can take: whole aligned blocks in the middle. None when the buffer and the
    offset do not agree modulo the alignment (no part can be aligned) or the part is small.
    """
    begin = -offset % DIRECT_ALIGN
    if (address + begin) % DIRECT_ALIGN:
        return None
    end = begin + (nbytes - begin) // DIRECT_ALIGN * DIRECT_ALIGN
    return (begin, end) if end - begin >= DIRECT_MIN_BYTES else None


class LocalFileWriter:
    """Positional writes to one new file.

    With ``direct``, a large write whose buffer and file offset agree modulo a page (an async
    save's staging lays its slabs out so) sends its aligned middle past the page cache
    (O_DIRECT) and only its ragged ends through it. Why: on a machine whose page cache grows
    into memory never touched before (a VM's), copying a checkpoint into the cache cost 3-4x
    the CPU of the direct write, taken from the cores that train. A file system that refuses
    O_DIRECT (tmpfs) gets every byte through the cache, as without ``direct``.
    """

    sequential = False

    def __init__(self, full_path: str, direct: bool = False) -> None:
        self.full_path = full_path
        self.fd = os.open(full_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct = direct and _O_DIRECT is not None
        self._direct_fd = -1
        self.direct_bytes = 0  # written past the page cache

    def write_at(self, data: memoryview, offset: int) -> None:
        start, nbytes = offset, len(data)
        span = (
            direct_span(buffer_address(data), offset, nbytes)
            if self._direct and nbytes >= DIRECT_MIN_BYTES
            else None
        )
        if span is not None:
            begin, end = span
            self._pwrite_all(data[:begin], offset)
            self._pwrite_direct(data[begin:end], offset + begin)
            self._pwrite_all(data[end:], offset + end)
            return
        self._pwrite_all(data, offset)
        if _start_writeback is not None and nbytes >= WRITEBACK_MIN_BYTES:
            _start_writeback(self.fd, start, nbytes)

    def _pwrite_direct(self, data: memoryview, offset: int) -> None:
        """Aligned whole blocks past the page cache; through it where the file system refuses."""
        fd = self._open_direct()
        while len(data) and fd >= 0:
            try:
                written = os.pwrite(fd, data, offset)  # releases the GIL
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # refused after all (an odd block size): cache from now on
                break
            self.direct_bytes += written
            data, offset = data[written:], offset + written
            if written % DIRECT_ALIGN:  # a short write left the rest unaligned
                break
        self._pwrite_all(data, offset)

    def _open_direct(self) -> int:
        if self._direct_fd < 0 and self._direct and _O_DIRECT is not None:
            try:
                self._direct_fd = os.open(self.full_path, os.O_WRONLY | _O_DIRECT)
            except OSError:  # tmpfs and some FUSE file systems: EINVAL
                self._direct = False
        return self._direct_fd

    def write_many(self, buffers: tuple[memoryview, ...], offset: int) -> int:
        """``buffers`` back to back from ``offset``, in vectored writes; returns the bytes."""
        start, total = offset, 0
        for first in range(0, len(buffers), IOV_MAX):
            group = list(buffers[first : first + IOV_MAX])
            size = sum(len(b) for b in group)
            written = os.pwritev(self.fd, group, offset)  # releases the GIL
            if written < size:  # a short write (rare on files): finish buffer by buffer
                self._write_rest(group, offset, written)
            offset += size
            total += size
        if _start_writeback is not None and total >= WRITEBACK_MIN_BYTES:
            _start_writeback(self.fd, start, total)
        return total

    def _write_rest(self, group: list[memoryview], offset: int, done: int) -> None:
        for buffer in group:
            if done >= len(buffer):
                done -= len(buffer)
            else:
                self._pwrite_all(buffer[done:], offset + done)
                done = 0
            offset += len(buffer)

    def _pwrite_all(self, data: memoryview, offset: int) -> None:
        while len(data):
            written = os.pwrite(self.fd, data, offset)  # releases the GIL
            data, offset = data[written:], offset + written

    def close(self, sync: bool = True) -> None:
        self._close_direct()
        fd, self.fd = self.fd, -1  # closed once: a second close could hit a reused fd number
        if fd < 0:
            return
        try:
            if sync:
                os.fsync(fd)  # the file's, whichever descriptor wrote its bytes
        finally:
            os.close(fd)

    def _close_direct(self) -> None:
        fd, self._direct_fd = self._direct_fd, -1
        if fd >= 0:
            os.close(fd)

    def abort(self) -> None:
        try:
            self._close_direct()
        except OSError:
            pass
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.full_path)
        except FileNotFoundError:
            pass


class LocalFileReader:
    """Positional reads from one open file; the kernel's readahead follows reads in order."""

    def __init__(self, full_path: str) -> None:
        self.full_path = full_path
        self.fd = os.open(full_path, os.O_RDONLY)

    def read_into(self, offset: int, out: memoryview) -> None:
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], offset + got)  # releases the GIL
            if not n:
                raise EOFError(
                    f"{self.full_path}: file ends at byte {offset + got}, expected {offset + len(out)}"
                )
            got += n

    def read_many(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` from consecutive bytes at ``offset`` (one vectored read)."""
        got = os.preadv(self.fd, buffers, offset)  # releases the GIL
        size = sum(len(b) for b in buffers)
        if got < size:  # a short read: finish buffer by buffer (EOFError at the file's end)
            for buffer in buffers:
                if got < len(buffer):
                    self.read_into(offset + got, buffer[got:])
                    got = 0
                else:
                    got -= len(buffer)
                offset += len(buffer)

    def close(self) -> None:
        os.close(self.fd)


class LocalStorage:
    """A directory on a local or parallel (POSIX) file system.

    ``direct_io``: large staged writes skip the page cache where they can (see
    LocalFileWriter); False keeps every byte in the cache, for a reader that follows at once.
    """

    def __init__(self, root: str, direct_io: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.direct_io = direct_io

    def _full(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def open_writer(self, path: str, size: int) -> LocalFileWriter:
        full = self._full(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return LocalFileWriter(full, direct=self.direct_io)

    def capabilities(self) -> Capabilities:
        """Every capability; the fast paths past ``read_into`` (or ``read_bytes``) only while
        that method is this class's: a subclass that overrides it, to count reads or inject
        faults, sees every read go through it."""
        reads = self if type(self).read_into is LocalStorage.read_into else None
        regular = self if type(self).read_bytes is LocalStorage.read_bytes else None
        return Capabilities(
            mappable=reads,
            file_readers=reads,
            page_cache=reads,
            link_check=self,
            regular_reads=regular,
            renames=self,
            creates_new=self,
        )

    def open_reader(self, path: str) -> LocalFileReader:
        """One open file for many positional reads (see engine/readorder.py for why)."""
        return LocalFileReader(self._full(path))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        with open(self._full(path), "rb", buffering=0) as f:
            f.seek(offset)
            got = 0
            while got < len(out):
                n = f.readinto(out[got:])
                if not n:
                    raise EOFError(
                        f"{self._full(path)}: file ends at byte {offset + got}, expected {offset + len(out)}"
                    )
                got += n

    def cached(self, path: str, offsets: list[int]) -> bool:
        """Whether the file's pages at ``offsets`` are all in the page cache (a read that may
        not wait for the disk, RWF_NOWAIT, gets them); True where the system cannot tell."""
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None:
            return True
        probe = memoryview(bytearray(1))
        try:
            fd = os.open(self._full(path), os.O_RDONLY)
        except OSError:  # the load that follows reports it, naming the key
            return True
        try:
            for offset in offsets:
                try:
                    os.preadv(fd, [probe], offset, flag)
                except BlockingIOError:
                    return False
                except OSError:  # flag refused by this file system
                    return True
        finally:
            os.close(fd)
        return True

    def map_file(self, path: str) -> mmap.mmap:
        """The file mapped into memory, private: the mapping is writable (torch and numpy
        views want that) and no write ever reaches the file."""
        with open(self._full(path), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise EOFError(f"{self._full(path)}: file is empty")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        return mapped

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self._full(path), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def read_regular(self, path: str, cap: int) -> bytes:
        """The bytes of a regular file, at most ``cap`` (``cap + 1`` read to detect more).

        Refuses symlinks (O_NOFOLLOW), FIFOs and devices (O_NONBLOCK, then fstat) with
        OSError(EINVAL); the byte cap does not trust ``st_size`` (/proc files report 0).
        """
        fd = os.open(self._full(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self._full(path))
            chunks, got = [], 0
            while got <= cap:
                piece = os.read(fd, min(cap + 1 - got, 16 << 20))
                if not piece:
                    break
                chunks.append(piece)
                got += len(piece)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def leaves_root(self, path: str) -> bool:
        """Whether ``path`` resolves (through symlinks) to a place outside the root. A reference
        to another step's file (``../step-<n>/...``, validated by the manifest) must resolve
        inside that step's directory, beside this one, itself no symlink."""
        root = os.path.realpath(self.root)
        if path.startswith("../"):
            step = path.split("/")[1]
            parent = os.path.realpath(os.path.dirname(os.path.abspath(self.root)))
            if os.path.islink(os.path.join(parent, step)):
                return True
            root = os.path.join(parent, step)
        return os.path.commonpath([root, os.path.realpath(self._full(path))]) != root

    def size(self, path: str) -> int:
        return os.stat(self._full(path)).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def listdir(self, path: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def write_atomic(self, path: str, data: bytes) -> None:
        write_atomic_local(self._full(path), data)

    def create_new(self, path: str, data: bytes) -> None:
        create_new_local(self._full(path), data)

    def remove(self, path: str) -> None:
        try:
            os.unlink(self._full(path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str = "") -> None:
        shutil.rmtree(self._full(path), ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        """One atomic rename within the root (not part of the Storage protocol)."""
        os.rename(self._full(src), self._full(dst))

    def makedirs(self, path: str = "") -> None:
        os.makedirs(self._full(path), exist_ok=True)

    def sync_dir(self, path: str = "") -> None:
        fd = os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def child(self, path: str) -> LocalStorage:
        return LocalStorage(self._full(path), self.direct_io)

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"
