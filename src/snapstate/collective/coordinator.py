"""The coordinator: every collective snapstate runs goes through one object.

Foreground steps (``all_gather``) run on the caller's thread, where collectives are safe;
an exception on one rank is raised on every rank (the failing rank raises its own error,
the others a CheckpointWorkerError with its traceback), so nobody hangs. Background steps
(``publish``, ``await_keys``, ``add``...) use a key-value store, never the training process
group: the commit of an async save happens off the main thread.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from snapstate.collective.key_wait import KeysTimeoutError
from snapstate.errors import CheckpointWorkerError, RankFailure

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def publish(self, key: str, value: str) -> None: ...

    def await_keys(self, keys: list[str], timeout: float) -> list[str]: ...

    def missing(self, keys: list[str]) -> list[str]: ...

    def add(self, key: str, amount: int) -> int: ...

    def delete_keys(self, keys: list[str]) -> None: ...


class LocalCoordinator:
    """One process: collectives are identities, the store is a dict."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self._store: dict[str, str] = {}
        self._cond = threading.Condition()

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def publish(self, key: str, value: str) -> None:
        with self._cond:
            self._store[key] = value
            self._cond.notify_all()

    def await_keys(self, keys: list[str], timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._store]
                if not missing:
                    return [self._store[k] for k in keys]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KeysTimeoutError(
                        f"timed out after {timeout}s waiting for {missing}", missing
                    )
                self._cond.wait(left)

    def missing(self, keys: list[str]) -> list[str]:
        with self._cond:
            return [k for k in keys if k not in self._store]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._store.get(key, "0")) + amount
            self._store[key] = str(value)
            return value

    def delete_keys(self, keys: list[str]) -> None:
        with self._cond:
            for k in keys:
                self._store.pop(k, None)


def gather_or_raise(
    coord: Coordinator, work: Callable[[], T], timeout: float | None = None
) -> list[T]:
    """Run ``work`` here, gather every rank's result; any rank's error is raised on all.

    ``timeout`` bounds the wait for the other ranks where the coordinator supports it (a
    torch.distributed one does): CheckpointTimeoutError rather than the group's own timeout.

    The rank that failed raises its own exception (its type is what callers expect, e.g.
    IncompatibleStateError); the other ranks raise CheckpointWorkerError naming it.
    """
    mine: Exception | None = None
    try:
        outcome: tuple[str, Any] = ("ok", work())
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        mine = exc
        outcome = ("error", (f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    if coord.world_size == 1 and mine is not None:
        raise mine
    gathered = gather_within(coord, outcome, timeout)
    if mine is not None:
        raise mine
    failures = [RankFailure(r, o[1][0], o[1][1]) for r, o in enumerate(gathered) if o[0] == "error"]
    if failures:
        raise CheckpointWorkerError(failures)
    return [o[1] for o in gathered]


def gather_within(coord: Coordinator, obj: Any, timeout: float | None) -> list[Any]:
    """``all_gather``, bounded by ``timeout`` where the coordinator can bound it."""
    if timeout is not None and coord.world_size > 1:
        bounded = getattr(coord, "all_gather_within", None)
        if bounded is not None:
            return bounded(obj, timeout)  # type: ignore[no-any-return]
    return coord.all_gather(obj)


_default: Coordinator | None = None


def default_coordinator(process_group: Any = None) -> Coordinator:
    """torch.distributed when initialized (see ``dist/torch_dist.py``), else one process."""
    global _default
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from snapstate.collective.torch_dist import TorchDistCoordinator

            return TorchDistCoordinator.for_group(process_group)
    except ImportError:
        pass
    if _default is None:
        _default = LocalCoordinator()
    return _default
