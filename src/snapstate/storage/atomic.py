"""Atomic publication of small files: the commit point of a checkpoint.

Two strategies exist because stores differ. On a POSIX file system a file is written to a
temporary name, fsynced, renamed over the target and the directory fsynced: readers see the
old state or the new one, never a torn file. Object stores have no rename, but a PUT is
atomic by itself: the object appears whole or not at all, so the manifest is simply written
last, after every shard is durable. Either way the manifest is the commit.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def write_atomic_local(full_path: str, data: bytes) -> None:
    _publish_local(full_path, data, os.replace)


def create_new_local(full_path: str, data: bytes) -> None:
    """Publish ``full_path`` whole, only if it does not exist (FileExistsError otherwise).

    The bytes are written aside and hard-linked into place: ``link`` refuses an existing
    name atomically, and a reader never sees the file before its bytes (an ``O_EXCL`` create
    followed by a write shows an empty file in between).
    """
    _publish_local(full_path, data, os.link)


def _publish_local(full_path: str, data: bytes, put: Callable[[str, str], None]) -> None:
    directory = os.path.dirname(full_path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(full_path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while len(view):
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        put(tmp, full_path)
    finally:
        try:
            os.unlink(tmp)  # gone after a replace; after a link, the name taken aside
        except FileNotFoundError:
            pass
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
