"""snapstate: asynchronous, fully parallel, reshardable, crash-consistent training checkpoints."""

from snapstate._version import __version__ as __version__
from snapstate.api import async_save, inspect, load, read_state, save, verify
from snapstate.engine.handle import SaveHandle, SaveOutcome, SaveResult
from snapstate.engine.load import LoadResult
from snapstate.engine.options import SaveOptions
from snapstate.engine.staging import HostBufferPool
from snapstate.engine.verify import VerifyReport
from snapstate.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWorkerError,
    CorruptCheckpointError,
    IncompatibleStateError,
    InconsistentStateError,
    NestingLimitError,
    ReplicaMismatchError,
    StateRestoreError,
    UnsupportedFormatError,
)
from snapstate.format.manifest import Manifest
from snapstate.hfexport import export_hf
from snapstate.manager import CheckpointManager
from snapstate.planning.layout import PlanOptions
from snapstate.state.rng import RNGState
from snapstate.state.stateful import RankLocal, Stateful

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CheckpointWorkerError",
    "CorruptCheckpointError",
    "HostBufferPool",
    "IncompatibleStateError",
    "InconsistentStateError",
    "LoadResult",
    "Manifest",
    "NestingLimitError",
    "PlanOptions",
    "RNGState",
    "RankLocal",
    "ReplicaMismatchError",
    "SaveHandle",
    "SaveOptions",
    "SaveOutcome",
    "SaveResult",
    "StateRestoreError",
    "Stateful",
    "UnsupportedFormatError",
    "VerifyReport",
    "async_save",
    "export_hf",
    "inspect",
    "load",
    "read_state",
    "save",
    "verify",
]
