"""The coordinator: every collective snapstate runs goes through one object.

Foreground steps (``all_gather``) run on the caller's thread, where collectives are safe;
an exception on one rank is raised on every rank with that rank's traceback, so nobody
hangs. Background steps (``publish``/``await_keys``) use a key-value store, never the
training process group: the commit of an async save happens off the main thread.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from snapstate.errors import CheckpointTimeoutError, CheckpointWorkerError, RankFailure

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def publish(self, key: str, value: str) -> None: ...

    def await_keys(self, keys: list[str], timeout: float) -> list[str]: ...


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
                    return [self._store.pop(k) for k in keys]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointTimeoutError(f"timed out after {timeout}s waiting for {missing}")
                self._cond.wait(left)


def gather_or_raise(coord: Coordinator, work: Callable[[], T]) -> list[T]:
    """Run ``work`` here, gather every rank's result; any rank's error is raised on all."""
    mine: Exception | None = None
    try:
        outcome: tuple[str, Any] = ("ok", work())
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        mine = exc
        outcome = ("error", (f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    if coord.world_size == 1 and mine is not None:
        raise mine
    gathered = coord.all_gather(outcome)
    failures = [RankFailure(r, o[1][0], o[1][1]) for r, o in enumerate(gathered) if o[0] == "error"]
    if failures:
        raise CheckpointWorkerError(failures) from mine
    return [o[1] for o in gathered]


_default: Coordinator | None = None


def default_coordinator(process_group: Any = None) -> Coordinator:
    """torch.distributed when initialized (see ``dist/torch_dist.py``), else one process."""
    global _default
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from snapstate.dist.torch_dist import TorchDistCoordinator

            return TorchDistCoordinator.for_group(process_group)
    except ImportError:
        pass
    if _default is None:
        _default = LocalCoordinator()
    return _default
