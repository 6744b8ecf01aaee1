"""Storage backends: local files, fsspec (object stores), and the atomic commit."""

from snapstate.storage.base import Storage, storage_for

__all__ = ["Storage", "storage_for"]
