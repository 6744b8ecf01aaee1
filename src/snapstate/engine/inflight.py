"""The one-save-in-flight rule, in one place: a new save first waits for the previous one.

``ss.save`` and ``ss.async_save`` hold their saves in the process's slot (``PROCESS``), so a
save never overlaps the one before it, and a process that exits right after ``async_save``
still commits its last checkpoint. A CheckpointManager holds its own saves in a slot of its
own as well, to apply retention once its save has committed.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

from snapstate.engine.background import wait_until_idle
from snapstate.engine.handle import SaveHandle, SaveResult

# How long exit waits for save threads to let go of finished jobs (microseconds, normally);
# a thread stuck on a dead peer must not hold the exit for long.
EXIT_IDLE_WAIT_S = 10.0


class SaveSlot:
    """At most one save in flight: ``start`` settles the previous save before the next one."""

    def __init__(self) -> None:
        self._handle: SaveHandle | None = None

    def start(self, begin: Callable[[], SaveHandle]) -> SaveHandle:
        """Settle the save in flight, then ``begin`` the next one and hold its handle."""
        self.settle()
        handle = begin()
        self._handle = handle
        return handle

    def settle(self) -> SaveResult | None:
        """Wait for the save in flight and let go of it; its result, or None when there was
        none or its error was already raised by a ``wait()``: an error is reported once, and
        one nobody saw is raised here."""
        handle, self._handle = self._handle, None
        if handle is None:
            return None
        if handle.observed and handle.error is not None:
            return None
        return handle.wait()

    def finish_at_exit(self) -> None:
        """Wait for the save in flight; its error has nobody left to go to."""
        handle = self._handle
        if handle is not None:
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - nothing left to report to at exit
                pass


PROCESS = SaveSlot()  # the slot of ss.save and ss.async_save: one save in flight per process


@atexit.register
def _finish_in_flight() -> None:
    PROCESS.finish_at_exit()
    wait_until_idle(EXIT_IDLE_WAIT_S)  # see engine/background.py: a busy thread aborts exit
