"""The timeout of a wait for keys in the key-value store, naming the keys that never came.

Its own module so that the coordinators (``coordinator.py``, ``torch_dist.py``) and the
barrier share it without importing each other.
"""

from __future__ import annotations

from snapstate.errors import CheckpointTimeoutError


class KeysTimeoutError(CheckpointTimeoutError):
    """``await_keys`` ran out of time; ``missing`` lists the keys that never appeared."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
