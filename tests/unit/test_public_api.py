"""The public surface: ``snapstate.__all__`` is sorted, complete and importable."""

from __future__ import annotations

import importlib.metadata
import inspect
import typing

import snapstate as ss
from snapstate import errors

# The names DESIGN.md's "Public API" section promises.
# fmt: skip
DESIGN_NAMES = {
    "save",
    "async_save",
    "load",
    "verify",
    "inspect",
    "CheckpointManager",
    "RNGState",
    "RankLocal",
    "Stateful",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "CheckpointTimeoutError",
}
# What users meet through those: results, handles, options, reports, the other errors.
# fmt: skip
USER_NAMES = {
    "SaveHandle",
    "SaveResult",
    "LoadResult",
    "VerifyReport",
    "Manifest",
    "SaveOptions",
    "PlanOptions",
    "HostBufferPool",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointWorkerError",
    "UnsupportedFormatError",
}


def test_all_is_sorted_without_duplicates() -> None:
    assert ss.__all__ == sorted(ss.__all__)
    assert len(set(ss.__all__)) == len(ss.__all__)


def test_every_name_in_all_exists_and_is_documented() -> None:
    for name in ss.__all__:
        value = getattr(ss, name)
        assert inspect.getdoc(value), f"{name} has no docstring"


def test_design_and_user_names_are_exported() -> None:
    assert set(ss.__all__) >= DESIGN_NAMES | USER_NAMES


def test_every_error_class_is_exported() -> None:
    error_classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, ss.CheckpointError)
    }
    assert error_classes <= set(ss.__all__)
    for name in error_classes:
        assert getattr(ss, name) is getattr(errors, name)


def _public_types(annotation: object) -> set[type]:
    found = set()
    if isinstance(annotation, type) and annotation.__module__.startswith("snapstate"):
        found.add(annotation)
    for arg in typing.get_args(annotation):
        found |= _public_types(arg)
    return found


def test_types_in_public_signatures_are_exported() -> None:
    exported = {getattr(ss, n) for n in ss.__all__}
    for name in ("save", "async_save", "load", "verify", "inspect"):
        hints = typing.get_type_hints(getattr(ss, name))
        for hint in hints.values():
            for cls in _public_types(hint):
                if cls.__name__ != "Storage":  # a Protocol for backends, not for users
                    assert cls in exported, f"{name} uses {cls.__name__}, which is not exported"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict = {}
    exec("from snapstate import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(ss.__all__)


def test_version_matches_the_package_metadata() -> None:
    assert ss.__version__ == importlib.metadata.version("snapstate")
