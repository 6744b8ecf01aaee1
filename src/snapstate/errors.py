"""The exception tree of snapstate.

Every error snapstate raises on purpose derives from ``CheckpointError``, so one
``except ss.CheckpointError`` catches them all::

    CheckpointError (Exception)
     ├── CheckpointNotFoundError (also FileNotFoundError)   no committed checkpoint at the path
     ├── CorruptCheckpointError (also ValueError)           bytes or manifest fail validation
     │    └── UnsupportedFormatError                         unknown format name or version
     ├── IncompatibleStateError (also ValueError)           target state does not match the checkpoint
     ├── ReplicaMismatchError (also ValueError)             replicas of a tensor differ across ranks at save
     ├── InconsistentStateError (also ValueError)           ranks disagree on a shared key's dtype/shape
     ├── NestingLimitError (also ValueError)                a state or stored structure nested too deep
     ├── CheckpointTimeoutError (also TimeoutError)         a rank did not arrive in time
     ├── CheckpointIOError (also OSError, errno kept)       the OS refused a file (disk full, read-only)
     ├── CheckpointExistsError (also FileExistsError)       refusing to overwrite a committed checkpoint
     ├── CheckpointLockedError                              another manager holds the root
     ├── StateRestoreError                                  a Stateful's load_state_dict raised; the load was undone
     └── CheckpointWorkerError                              an error raised on another rank, with its traceback

Errors about the state the caller passes (a leaf that cannot be saved) are plain
``TypeError``s naming the key path, as Python users expect.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class CheckpointError(Exception):
    """Root of every snapstate error."""


class CheckpointIOError(CheckpointError, OSError):
    """The operating system refused a checkpoint's file (disk full, read-only, I/O error).

    Keeps ``errno`` and ``filename``; raised as a subclass of the original OSError's own type
    too (PermissionError...), so code that caught those still does.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was expected."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file or manifest failed validation; names the file and the key."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        where = ", ".join(
            p for p in (f"file {file}" if file else "", f"key {key!r}" if key else "") if p
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.reason = message
        self.file = file
        self.key = key


class UnsupportedFormatError(CorruptCheckpointError):
    """The manifest names a format or version this library cannot read."""


class MismatchKind(enum.Enum):
    """What sort of difference a StateMismatch is: callers branch on it, not on the text."""

    MISSING = "missing"  # the target asks for a key the checkpoint lacks
    DIFFERS = "differs"  # both hold the key and disagree: type, shape, dtype or structure
    REFUSED = "refused"  # per-rank state this load was told not to read


@dataclass
class StateMismatch:
    """One difference between a target state and a checkpoint."""

    key: str
    problem: str
    kind: MismatchKind = MismatchKind.DIFFERS

    @classmethod
    def missing(cls, key: str) -> StateMismatch:
        return cls(key, "missing in checkpoint", MismatchKind.MISSING)


class IncompatibleStateError(CheckpointError, ValueError):
    """The target state differs from the checkpoint; lists every difference at once."""

    def __init__(self, path: str, mismatches: list[StateMismatch]) -> None:
        self.path = path
        self.mismatches = mismatches
        lines = "\n".join(f"  {m.key}: {m.problem}" for m in mismatches[:50])
        more = f"\n  ... and {len(mismatches) - 50} more" if len(mismatches) > 50 else ""
        super().__init__(
            f"state does not match checkpoint {path} ({len(mismatches)} differences):\n{lines}{more}"
        )

    @property
    def missing(self) -> list[str]:
        return [m.key for m in self.mismatches if m.kind is MismatchKind.MISSING]


class ReplicaMismatchError(CheckpointError, ValueError):
    """Ranks that should hold identical copies of a tensor (DDP replicas) hold different bytes."""


class InconsistentStateError(CheckpointError, ValueError):
    """Ranks disagree on the dtype, shape or placement of a shared key."""


class NestingLimitError(CheckpointError, ValueError):
    """A state (on save) or a stored structure (on load) is nested deeper than the one limit
    both share; names the key path. A limit, not damage: the manager never sets it aside."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Other ranks did not arrive within the timeout; nothing was committed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists at the path."""


class CheckpointLockedError(CheckpointError):
    """Another live CheckpointManager holds the lock on the root."""


class StateRestoreError(CheckpointError):
    """A Stateful object's ``load_state_dict`` raised during a load. Everything the load had
    changed (tensors, container slots, the Stateful objects loaded before it) was put back;
    ``__cause__`` is the object's own exception and ``key`` its key path. Not damage: the
    checkpoint is fine, the object refused it (the manager never sets the step aside)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    error: str
    traceback: str = ""


class CheckpointWorkerError(CheckpointError):
    """An error raised on one or more ranks, re-raised on every rank with the originals."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        detail = "\n".join(f"rank {f.rank}: {f.error}\n{f.traceback}".rstrip() for f in failures)
        super().__init__(f"checkpoint failed on rank(s) {[f.rank for f in failures]}:\n{detail}")


@dataclass
class SkippedKeys:
    """What a non-strict load left untouched."""

    missing: list[str] = field(default_factory=list)
    mismatched: list[StateMismatch] = field(default_factory=list)
