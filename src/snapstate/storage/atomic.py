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


def write_atomic_local(full_path: str, data: bytes) -> None:
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
        os.replace(tmp, full_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
