"""A lock file per checkpoint root: one writer at a time, stale locks of dead pids taken over.

Taking the lock (reading the holder, judging it stale, writing ourselves) runs under an
exclusive ``flock`` of the root directory itself (no extra file) on local and parallel file systems, so two managers that
find the same dead holder cannot both take over. A new lock is created with the store's
conditional create (``CreatesNew``: a hard link on POSIX, ``If-None-Match: *`` on S3), so of
two managers starting at once exactly one gets it; on a store without one (and when a stale
lock is taken over on an object store) the check-then-write stays best effort. A lock that cannot be
judged from here (a pid on another host, or a pid reused by an unrelated process) is never
taken over: ``break_lock(root)`` removes it once the user knows its holder is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import uuid
import weakref
from collections.abc import Iterator

from snapstate.errors import CheckpointLockedError
from snapstate.storage.base import Storage, capabilities, read_capped, storage_for

LOCK_FILE = ".snapstate.lock"
MAX_LOCK_BYTES = 64 << 10  # a holder is a few hundred bytes of JSON


# Locks held by this process, by token: a second manager in the same process (same pid) is
# refused while the first lives, and takes over once it is gone without closing.
_HELD: weakref.WeakValueDictionary[str, RootLock] = weakref.WeakValueDictionary()


def _alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0 or -1, 0) would ask about whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RootLock:
    """Held by the manager's coordinator rank for its lifetime."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.token = uuid.uuid4().hex
        self.owner: dict[str, object] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self.token,
        }
        self.held = False

    def acquire(self) -> None:
        with self._guard():
            holder = self._read_holder()
            if holder is not None and holder != self.owner and self._holder_alive(holder):
                raise CheckpointLockedError(
                    f"{self.storage.root} is locked by pid {holder.get('pid')} on "
                    f"{holder.get('host')} ({LOCK_FILE}); another CheckpointManager is writing "
                    "there. If that process is gone (another host, a reused pid), remove the "
                    "lock with snapstate.lock.break_lock(root)"
                )
            self._create(take_over=holder is not None)
        self.held = True
        _HELD[self.token] = self

    def release(self) -> None:
        if self.held and self._read_holder() == self.owner:
            self.storage.remove(LOCK_FILE)
        self.held = False
        _HELD.pop(self.token, None)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Serialize lock takeovers between processes (local and parallel file systems)."""
        if "://" in self.storage.root or not os.path.isdir(self.storage.root):
            yield
            return
        fd = os.open(self.storage.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a write: milliseconds
            yield
        finally:
            os.close(fd)  # releases the flock

    def _holder_alive(self, holder: dict) -> bool:
        if holder.get("host") != self.owner["host"]:
            return True  # a pid on another host cannot be checked from here
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return False
        if pid == os.getpid():
            return holder.get("token") in _HELD
        return _alive(pid)

    def _create(self, take_over: bool) -> None:
        data = json.dumps(self.owner).encode()
        creates_new = capabilities(self.storage).creates_new
        if not take_over and creates_new is not None:
            try:
                creates_new.create_new(LOCK_FILE, data)  # one of two racing managers wins
                return
            except FileExistsError:
                raise CheckpointLockedError(
                    f"{self.storage.root} was locked by another manager just now ({LOCK_FILE})"
                ) from None
            except NotImplementedError:
                pass  # a store without a conditional create: best effort, below
        self.storage.write_atomic(LOCK_FILE, data)

    def _read_holder(self) -> dict | None:
        try:
            raw = read_capped(self.storage, LOCK_FILE, MAX_LOCK_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a FIFO, device, directory or symlink: never read, never taken
            raise CheckpointLockedError(
                f"the lock file {LOCK_FILE} of {self.storage.root} is not a regular file "
                f"({exc.strerror}); remove it once no manager uses the root"
            ) from exc
        if len(raw) > MAX_LOCK_BYTES:
            raise CheckpointLockedError(
                f"the lock file {LOCK_FILE} of {self.storage.root} holds over {MAX_LOCK_BYTES} "
                "bytes: not a snapstate lock; remove it once no manager uses the root"
            )
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = None
        # A torn or foreign lock file is stale.
        return holder if isinstance(holder, dict) else {"pid": -1, "host": self.owner["host"]}


def break_lock(root: str | os.PathLike[str] | Storage) -> dict | None:
    """Remove the lock of ``root`` whatever holds it, and return the holder it named.

    The documented way out when the holder cannot be checked from here (it ran on another
    host, or its pid now belongs to another process): call it only once that manager is gone.
    """
    storage = storage_for(root)
    lock = RootLock(storage)
    with lock._guard():
        holder = lock._read_holder()
        storage.remove(LOCK_FILE)
    return holder
