"""Typed values: the non-JSON values real checkpoints hold, stored as tagged JSON, never pickled.

A typed node is ``{"x": tag, "v": json}`` for an atom (dtype, device, Size, Path, datetime,
date, time, timedelta) or ``{"x": tag, "c": node}`` around a child node (set, frozenset,
argparse.Namespace); an Enum member is ``{"x": "enum", "v": "module:qualname", "c": node}``.
Loading imports nothing: an Enum comes back as a member of its class only when that class is
already imported in the loading process (looked up in ``sys.modules``) or the target holds a
member of it, and the member is found by value among the class's members, so no code a
checkpoint names runs on load. See ``format/SPEC.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import sys
from pathlib import Path, PurePath, PureWindowsPath
from typing import Any

import torch

# isinstance against one tuple: the flatten walk asks it of every value off its fast paths
TYPED_BASES = (
    torch.dtype,
    torch.device,
    torch.Size,
    PurePath,
    argparse.Namespace,
    enum.Enum,
    dt.date,
    dt.time,
    dt.timedelta,
    set,
    frozenset,
)


def atom_payload(obj: Any, path: str) -> tuple[str, Any] | None:
    """(tag, JSON payload) of an atom, or None when ``obj`` is a typed container."""
    if isinstance(obj, torch.dtype):
        return "dtype", str(obj).removeprefix("torch.")
    if isinstance(obj, torch.device):
        return "device", str(obj)
    if isinstance(obj, torch.Size):
        return "size", list(obj)
    if isinstance(obj, PurePath):
        return "path", ["Path" if isinstance(obj, Path) else _pure_name(obj), str(obj)]
    if isinstance(obj, (dt.datetime, dt.time)):
        _check_zone(obj, path)
        return ("datetime" if isinstance(obj, dt.datetime) else "time"), obj.isoformat()
    if isinstance(obj, dt.date):
        return "date", obj.isoformat()
    if isinstance(obj, dt.timedelta):
        return "timedelta", [obj.days, obj.seconds, obj.microseconds]
    return None


def _pure_name(obj: PurePath) -> str:
    return "PureWindowsPath" if isinstance(obj, PureWindowsPath) else "PurePosixPath"


def _check_zone(obj: dt.datetime | dt.time, path: str) -> None:
    if obj.tzinfo is not None and type(obj.tzinfo) is not dt.timezone:
        raise TypeError(
            f"cannot checkpoint the {type(obj).__name__} at key {path!r}: its tzinfo "
            f"{type(obj.tzinfo).__name__} is code, not data; convert it to UTC or a fixed "
            "offset (datetime.timezone) first"
        )


def container_parts(obj: Any) -> tuple[str, Any, str | None]:
    """(tag, the value to store as the child node, the enum class path or None)."""
    if isinstance(obj, enum.Enum):
        cls = type(obj)
        return "enum", obj.value, f"{cls.__module__}:{cls.__qualname__}"
    if isinstance(obj, argparse.Namespace):
        return "namespace", dict(vars(obj)), None
    tag = "frozenset" if isinstance(obj, frozenset) else "set"
    return tag, sorted(obj, key=lambda v: (type(v).__name__, repr(v))), None


def enum_class(class_path: str, target: Any) -> type[enum.Enum] | None:
    """The Enum class named ``module:qualname`` if the target holds a member of it or it is
    already imported; nothing is imported here."""
    if isinstance(target, enum.Enum) and _class_path(type(target)) == class_path:
        return type(target)
    module_name, _, qualname = class_path.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if found is not None and qualname else ():
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, enum.Enum):
        return found
    return None


def enum_member(cls: type[enum.Enum], value: Any) -> enum.Enum | None:
    """The member of ``cls`` with ``value``, found without calling the class (no _missing_)."""
    for member in cls.__members__.values():
        if type(member.value) is type(value) and member.value == value:
            return member
    return None


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
