"""The typed atoms of a stored structure: their tags, and the value each payload decodes to.

Both the validation of untrusted structure (``format/tree.py``) and the restore
(``state/restore.py``) decode an atom; encoding values is ``state/typed.py``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch

ATOM_TAGS = frozenset({"dtype", "device", "size", "path", "datetime", "date", "time", "timedelta"})
CHILD_TAGS = frozenset({"set", "frozenset", "namespace", "enum"})
_PATHS: dict[str, type[PurePath]] = {
    "Path": Path,
    "PurePosixPath": PurePosixPath,
    "PureWindowsPath": PureWindowsPath,
}


def decode_atom(tag: str, payload: Any) -> Any:
    """The value of a validated atom node (``format/tree.py`` checked its payload's shape)."""
    if tag == "dtype":
        return dtype_named(payload)
    if tag == "device":
        return torch.device(payload)
    if tag == "size":
        return torch.Size(payload)
    if tag == "path":
        return _PATHS[payload[0]](payload[1])
    if tag == "datetime":
        return dt.datetime.fromisoformat(payload)
    if tag == "time":
        return dt.time.fromisoformat(payload)
    if tag == "date":
        return dt.date.fromisoformat(payload)
    return dt.timedelta(days=payload[0], seconds=payload[1], microseconds=payload[2])


def dtype_named(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


def atom_problem(tag: str, payload: Any) -> str | None:
    """What is wrong with an atom node's payload (untrusted input), or None."""
    try:
        decode_atom(tag, payload)
    except Exception as exc:  # noqa: BLE001 - untrusted input: any failure is a bad payload
        return f"{tag} value {payload!r} is invalid: {exc}"[:200]
    return None
