"""Handles and results of saves: wait(), done(), and the figures a save reports."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from snapstate.engine.background import run_in_background
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

    def done(self) -> bool:
        """A result is a save that is over (so it is a SaveOutcome, like a SaveHandle)."""
        return True

    def wait(self, timeout: float | None = None) -> SaveResult:
        """The result itself: a finished save has nothing left to wait for."""
        return self


class SaveOutcome(Protocol):
    """What ``CheckpointManager.save`` returns: a SaveHandle while the save is in flight
    (an async manager), its SaveResult once it is over (a blocking one); ``wait()`` gives
    the SaveResult either way, or raises the save's error."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> SaveResult: ...


class SaveHandle:
    """An asynchronous save in flight. ``wait()`` returns its SaveResult or raises its error."""

    def __init__(
        self, run: Callable[[], SaveResult] | None = None, result: SaveResult | None = None
    ) -> None:
        self._result = result
        self._error: BaseException | None = None
        self.observed = result is not None
        self._finished = threading.Event()
        if run is None:
            self._finished.set()
        else:
            run_in_background(lambda: self._target(run))

    def _target(self, run: Callable[[], SaveResult]) -> None:
        try:
            self._result = run()
        except BaseException as exc:  # noqa: BLE001 - raised again on wait()
            self._error = exc
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        if not self._finished.wait(timeout):
            raise CheckpointTimeoutError(f"save still running after {timeout}s")
        self.observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error if self.done() else None
