"""An exclusive claim on a checkpoint directory while one save writes it (local file systems).

Two processes saving to one path at once would write the same shard files. Rank 0 of a save
therefore claims the directory before any rank writes: an ``flock`` on a small file in it,
which the kernel drops when the holder dies, so a killed save never leaves a claim behind.
Without overwrite a claim held by another save is a CheckpointExistsError at once: exactly one
writer wins. With overwrite the save waits for the claim, so the last commit wins whole.
The holder unlinks the file before letting go; a waiter that locked a file already unlinked
(its inode is no longer the path's) tries again. Object stores have no such lock: there two
savers of one path are best effort (see README).
"""

from __future__ import annotations

import fcntl
import os
import time

from snapstate.errors import CheckpointExistsError, CheckpointTimeoutError
from snapstate.storage.base import Storage
from snapstate.storage.local import LocalStorage

CLAIM = ".snapstate-save.claim"
_POLL_S = 0.005


class Claim:
    """A held claim; ``release`` is idempotent."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # the directory went away with the claim in it
        finally:
            os.close(fd)  # drops the lock


def claim_target(storage: Storage, wait: bool, timeout: float) -> Claim | None:
    """Claim ``storage``'s directory for one save; None where the store has no file locks."""
    if not isinstance(storage, LocalStorage):
        return None
    storage.makedirs()
    path = os.path.join(storage.root, CLAIM)
    deadline = time.monotonic() + timeout
    while True:
        claim = _try_claim(path)
        if claim is not None:
            return claim
        if not wait:
            raise CheckpointExistsError(
                f"another save is writing {storage.root} (its claim {path} is held)"
            )
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(
                f"another save kept writing {storage.root} for {timeout:.0f} s (claim {path})"
            )
        time.sleep(_POLL_S)


def _try_claim(path: str) -> Claim | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not _same_file(fd, path):  # the holder unlinked it as we opened it: a stale inode
        os.close(fd)
        return _try_claim(path)
    return Claim(fd, path)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
