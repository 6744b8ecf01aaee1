"""Checks of untrusted JSON values, shared by the manifest and the marker validators.

Each check returns the value it accepted or raises a CorruptCheckpointError naming the file
and the key; ``format/manifest.py`` and ``format/marker.py`` build their records on top.
"""

from __future__ import annotations

import re
from typing import Any

from snapstate.errors import CorruptCheckpointError

# A step directory's name (the manager's ``step-<9+ digits>``): the only directory a manifest's
# reference to another step's file (format version 4) may name.
STEP_NAME = re.compile(r"step-(\d{9,})")
MAX_INT = (1 << 63) - 1  # sizes, offsets and byte positions must fit torch's and the OS's int64


def short(value: Any, most: int = 120) -> str:
    """``repr(value)`` cut to ``most`` characters, without formatting a huge list whole."""
    if isinstance(value, list) and len(value) > 16:
        return f"[{', '.join(repr(x)[:20] for x in value[:8])}, ... {len(value)} items]"[:most]
    return repr(value)[:most]


class FieldChecks:
    """The checks of one file's JSON values: each failure names the file and the key."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, file=self.file, key=key)

    def require(self, ok: bool, message: str, key: str | None = None) -> None:
        if not ok:
            raise self.fail(message, key)

    def mapping(self, value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{key} is not an object", key)
        return value

    # Messages are built only on failure: formatting them per element made validation of a
    # 16,000-dimension shape quadratic (33 s).
    def integer(self, value: Any, key: str, minimum: int = 0) -> int:
        # type(...) is int: json gives exact ints, and this also refuses bools
        if not (type(value) is int and minimum <= value <= MAX_INT):
            raise self.fail(f"{short(value)} is not an integer in [{minimum}, 2**63)", key)
        return value

    def ints(self, value: Any, key: str, length: int | None = None) -> list[int]:
        if not (type(value) is list and (length is None or len(value) == length)):
            raise self.fail(f"expected a list of {length} integers, got {short(value)}", key)
        if all(type(x) is int and 0 <= x <= MAX_INT for x in value):
            return value
        return [self.integer(x, key) for x in value]  # raises, naming the bad element
