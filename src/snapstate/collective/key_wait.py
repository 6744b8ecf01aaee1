"""Waits for keys in the key-value store: how they poll, and the timeout naming the keys that
never came.

Its own module so that the coordinators (``coordinator.py``, ``torch_dist.py``) and the
barrier share it without importing each other.
"""

from __future__ import annotations

import time

from snapstate.errors import CheckpointTimeoutError

POLL_MIN_S = 0.0005
POLL_MAX_S = 0.1
POLL_FRACTION = 0.1


class Poll:
    """The pauses of a wait that polls the store: a tenth of the time waited so far, within
    [POLL_MIN_S, POLL_MAX_S].

    A doubling backoff (2, 4, 8, 16 ms...) woke a 17 ms wait at 30 ms, and the commit of every
    save waits three times in a row (arrivals, the decision, its acknowledgements); this one
    oversleeps by a tenth of the wait, at the cost of about 40 polls in the first 100 ms.
    """

    def __init__(self) -> None:
        self.started = time.monotonic()

    def sleep(self) -> None:
        waited = time.monotonic() - self.started
        time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, waited * POLL_FRACTION)))


class KeysTimeoutError(CheckpointTimeoutError):
    """``await_keys`` ran out of time; ``missing`` lists the keys that never appeared."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
