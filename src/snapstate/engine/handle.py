"""Handles and results of saves: wait(), done(), and the figures a save reports."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from snapstate.errors import CheckpointTimeoutError


@dataclass
class SaveResult:
    """What one rank's part of a save did; ``manifest_bytes`` is set where the commit ran."""

    path: str
    step: int | None
    rank: int
    world_size: int
    bytes_written: int
    files: list[str]
    blocking_s: float
    persist_s: float
    commit_s: float
    total_s: float
    timings: dict[str, float] = field(default_factory=dict)


class SaveHandle:
    """An asynchronous save in flight. ``wait()`` returns its SaveResult or raises its error."""

    def __init__(
        self, run: Callable[[], SaveResult] | None = None, result: SaveResult | None = None
    ) -> None:
        self._result = result
        self._error: BaseException | None = None
        self.observed = result is not None
        self._thread: threading.Thread | None = None
        if run is not None:
            self._thread = threading.Thread(
                target=self._target, args=(run,), name="snapstate-save", daemon=True
            )
            self._thread.start()

    def _target(self, run: Callable[[], SaveResult]) -> None:
        try:
            self._result = run()
        except BaseException as exc:  # noqa: BLE001 - raised again on wait()
            self._error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SaveResult:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CheckpointTimeoutError(f"save still running after {timeout}s")
        self.observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error if self.done() else None
