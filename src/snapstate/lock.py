"""A lock file per checkpoint root: one writer at a time, stale locks of dead pids taken over."""

from __future__ import annotations

import json
import os
import socket

from snapstate.errors import CheckpointLockedError
from snapstate.storage.base import Storage

LOCK_FILE = ".snapstate.lock"


def _alive(pid: int) -> bool:
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
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> None:
        holder = self._read_holder()
        if holder is not None and holder != self.owner:
            if holder.get("host") != self.owner["host"] or _alive(int(holder.get("pid", -1))):
                raise CheckpointLockedError(
                    f"{self.storage.root} is locked by pid {holder.get('pid')} on {holder.get('host')} "
                    f"({LOCK_FILE}); another CheckpointManager is writing there"
                )
        self._create(take_over=holder is not None)
        self.held = True

    def release(self) -> None:
        if self.held and self._read_holder() == self.owner:
            self.storage.remove(LOCK_FILE)
        self.held = False

    def _create(self, take_over: bool) -> None:
        if "://" in self.storage.root or take_over:
            self.storage.write_atomic(LOCK_FILE, json.dumps(self.owner).encode())
            return
        path = os.path.join(self.storage.root, LOCK_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise CheckpointLockedError(f"{self.storage.root} was locked by another manager just now ({LOCK_FILE})") from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.owner))

    def _read_holder(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(LOCK_FILE))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"pid": -1, "host": self.owner["host"]}  # torn lock: treat as stale
