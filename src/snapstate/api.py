"""The functional API: save, async_save, load, verify, inspect."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Literal

from snapstate.collective.coordinator import default_coordinator
from snapstate.collective.loadshare import fail_together
from snapstate.collective.topology import host_count
from snapstate.engine.gcpause import paused as gc_paused
from snapstate.engine.handle import SaveHandle, SaveResult
from snapstate.engine.inflight import PROCESS
from snapstate.engine.load import LoadResult, load_into
from snapstate.engine.options import SaveOptions, with_keywords
from snapstate.engine.save import start_save
from snapstate.engine.staging import HostBufferPool
from snapstate.engine.verify import VerifyReport, read_manifest, verify_checkpoint
from snapstate.errors import CheckpointError
from snapstate.format.manifest import Manifest
from snapstate.storage.base import Storage, storage_for

PathLike = str | os.PathLike[str] | Storage  # a directory, a URL, or a Storage object

_lock = threading.Lock()
_pool: HostBufferPool | None = None


def default_pool() -> HostBufferPool:
    """The process-wide staging pool, kept warm between async saves."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = HostBufferPool()
        return _pool


def wait_for_pending() -> None:
    """Block until the previous async save ends; raise its error if nobody saw it yet."""
    PROCESS.settle()


def save(
    state: Any,
    path: PathLike,
    *,
    step: int | None = None,
    process_group: Any = None,
    timeout: float | None = None,
    overwrite: bool | None = None,
    options: SaveOptions | None = None,
) -> SaveResult:
    """Save ``state`` to the directory ``path`` and return once it is committed.

    Collective when torch.distributed is initialized: every rank of ``process_group`` calls it.
    ``timeout`` and ``overwrite`` are the SaveOptions fields of the same names (None: the
    options' value); one that contradicts a field ``options`` sets is a ValueError.
    """
    opts = with_keywords(options, timeout=timeout, overwrite=overwrite)
    return _start(state, path, step, process_group, opts, pool=None).wait()


def async_save(
    state: Any,
    path: PathLike,
    *,
    step: int | None = None,
    process_group: Any = None,
    timeout: float | None = None,
    overwrite: bool | None = None,
    options: SaveOptions | None = None,
    pool: HostBufferPool | None = None,
) -> SaveHandle:
    """Stage ``state`` into host buffers and return; writing and commit continue in the background.

    After it returns the caller may change its tensors freely: the checkpoint holds the values
    of the moment of the call. One save is in flight at a time per process: a new save first
    waits for the previous one (and raises its error if it failed unobserved). The keywords
    are those of ``save``.
    """
    opts = with_keywords(options, timeout=timeout, overwrite=overwrite)
    return _start(state, path, step, process_group, opts, pool=pool or default_pool())


def _start(
    state: Any,
    path: PathLike,
    step: int | None,
    process_group: Any,
    options: SaveOptions,
    pool: HostBufferPool | None,
) -> SaveHandle:
    """Both saves, once the previous one is over: async when a staging ``pool`` is given."""
    return PROCESS.start(
        lambda: start_save(
            state,
            storage_for(path),
            default_coordinator(process_group),
            pool=pool,
            step=step,
            options=options,
        )
    )


def load(
    state: Any,
    path: PathLike,
    *,
    strict: bool = True,
    process_group: Any = None,
    rank_local: Literal["load", "skip"] = "load",
    timeout: float | None = None,
    read_once: bool | None = None,
) -> LoadResult:
    """Fill ``state`` in place from the checkpoint at ``path``.

    Tensors are copied into the state's tensors, Stateful objects get ``load_state_dict``,
    plain values are replaced. Keys the checkpoint has and the state lacks are ignored (load
    ``{"model": model}`` alone from a full training checkpoint); a target that matches no key
    of the checkpoint is an IncompatibleStateError. Per-rank state (``RNGState``, data
    loaders, ``RankLocal``) loads on the rank that saved it; on another world size the
    per-rank keys the target asks for are refused unless ``rank_local="skip"``.
    Collective when torch.distributed is initialized: with ``read_once=True`` bytes that
    several ranks need (replicated tensors) are read by one rank and sent to the others;
    ``read_once=False`` lets every rank read what it needs for itself; the default (None)
    reads once only when the ranks span several hosts (see ``engine/transport.py``).
    ``timeout`` (seconds) bounds every wait of the load for the other ranks: a rank that does
    not take part in time (stopped, hung, dead) is a CheckpointTimeoutError on the others,
    whose state is left as it was; None waits as long as the process group does.
    """
    storage = storage_for(path)
    coord = default_coordinator(process_group)
    hosts = host_count(coord, timeout)  # one gather per process group, then cached
    with gc_paused():  # the manifest's objects would otherwise trigger full collections
        try:
            manifest = read_manifest(storage)
        except CheckpointError as exc:
            if coord.world_size > 1:  # the others are entering the load's collective: fail them
                fail_together(coord, exc, timeout)
            raise
        rank = coord.rank if rank_local == "load" else None
        refusal = None
        if rank is not None and manifest.rank_local and manifest.world_size != coord.world_size:
            # only the per-rank keys the target asks for are refused (load_into names them)
            refusal, rank = rank_local_refusal(manifest.world_size, coord.world_size), None
        return load_into(
            state,
            storage,
            manifest,
            rank,
            strict=strict,
            coord=coord,
            read_once=read_once,
            hosts=hosts,
            rank_local_refusal=refusal,
            timeout=timeout,
        )


def rank_local_refusal(saved_on: int, world_size: int) -> str:
    """Per-rank state (data loaders, RNGState, RankLocal) cannot be dealt to another world size."""
    return (
        f"per-rank state saved on {saved_on} ranks, loading on {world_size}; pass "
        "rank_local='skip' to leave it as it is (a loader over snapstate.data.ElasticSampler "
        "resumes anyway if the sampler itself is in the state: its position is global)"
    )


def read_state(
    path: PathLike, keys: Sequence[str] | None = None, *, rank: int | None = None
) -> dict[str, Any]:
    """Read the checkpoint at ``path`` as plain nested containers, with no target to fill.

    ``keys`` are key paths (``"model"``, ``"model/layer1.weight"``, ``"optim/state/0"``;
    a ``/`` inside a key is written ``%2F``); None reads everything readable. The result is
    nested from the root (``read_state(p, ["model"])["model"]`` is the model's state dict):
    Stateful objects come back as their state dicts, sharded tensors whole, numpy values as
    numpy, typed values (dtype, Path, datetime, sets...) as their types. Per-rank state
    (RNGState, data loaders, RankLocal) is that of ``rank`` (default: this process's rank,
    0 without torch.distributed); with ``keys=None`` it is left out when the checkpoint holds
    none for that rank, and a per-rank key asked for explicitly is then an
    IncompatibleStateError, as is a key the checkpoint lacks. Reads on this process only:
    not a collective.
    """
    from snapstate.engine.readstate import read_plain

    storage = storage_for(path)
    with gc_paused():
        manifest = read_manifest(storage)
        return read_plain(storage, manifest, keys, _this_rank() if rank is None else rank)  # type: ignore[no-any-return]


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def verify(path: PathLike) -> VerifyReport:
    """Check every checksum and header; raises CorruptCheckpointError naming file and key."""
    return verify_checkpoint(storage_for(path))


def inspect(path: PathLike) -> Manifest:
    """The validated manifest of a committed checkpoint."""
    return read_manifest(storage_for(path))
