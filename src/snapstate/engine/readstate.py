"""Read a checkpoint as plain nested containers (no target): the keys asked for, one rank's view."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from snapstate.engine.chunkread import load_errors
from snapstate.engine.headers import ShardHeaders
from snapstate.engine.load import (
    DEFAULT_READ_THREADS,
    plan_tasks,
    records_for,
    run_reads,
    stored_lookup,
)
from snapstate.errors import IncompatibleStateError, StateMismatch
from snapstate.format.manifest import Manifest, TensorRecord
from snapstate.state.flatten import escape_component
from snapstate.state.restore import RestorePlan, plan_materialize
from snapstate.storage.base import Storage


def read_plain(
    storage: Storage,
    manifest: Manifest,
    keys: Sequence[str] | None,
    rank: int | None,
    threads: int = DEFAULT_READ_THREADS,
) -> dict[str, Any] | Any:
    """The checkpoint's values under ``keys`` (all if None), rank-local ones of ``rank``.

    ``rank=None`` or a rank the checkpoint has no state of leaves per-rank values out; a key
    asked for that lies in per-rank state is then an IncompatibleStateError, as is a key the
    checkpoint lacks, or an Enum whose class is not imported.
    """
    planned = _plan(storage, manifest, keys, rank)
    if planned.plan.mismatches:  # before any byte is read
        raise IncompatibleStateError(storage.root, planned.plan.mismatches)
    _read(storage, planned, manifest, rank, threads)
    return planned.value


def read_available(
    storage: Storage,
    manifest: Manifest,
    keys: Sequence[str] | None,
    rank: int | None,
    threads: int = DEFAULT_READ_THREADS,
) -> tuple[Any, list[StateMismatch]]:
    """As :func:`read_plain`, but values that cannot be read here (an Enum of a class not
    imported) are left out and listed instead; per-rank values without a rank too, when
    ``keys`` is None. What a consolidating export needs."""
    planned = _plan(storage, manifest, keys, rank)
    _read(storage, planned, manifest, rank, threads)
    skipped = [StateMismatch(p, "per-rank state, of no rank here") for p in planned.plan.skipped]
    left_out = skipped if keys is None and rank is None else []
    return planned.value, planned.plan.mismatches + left_out


class _Planned(NamedTuple):
    value: Any  # the structure, its tensors allocated, not yet read
    plan: RestorePlan
    find: Callable[[str, bool], TensorRecord | None]
    wanted: tuple[str, ...]  # the key paths asked for (none: everything)


def _plan(
    storage: Storage, manifest: Manifest, keys: Sequence[str] | None, rank: int | None
) -> _Planned:
    """The structure to fill, its tensors allocated once their shards' headers agree with
    the manifest (``records_for``)."""
    wanted = tuple(k.strip("/") for k in keys) if keys is not None else None
    valid = rank if rank is not None and rank in manifest.rank_local else None
    trees = manifest.rank_local[valid].trees if valid is not None else None
    find = records_for(manifest, valid, ShardHeaders(storage, manifest))
    value, plan = plan_materialize(manifest.tree, stored_lookup(find), trees, wanted)
    return _Planned(value, plan, find, wanted or ())


def _read(
    storage: Storage, planned: _Planned, manifest: Manifest, rank: int | None, threads: int
) -> None:
    value, plan, find, wanted = planned
    plan.apply_structure()  # fresh containers: nothing of the caller's to keep if a read fails
    problems = _unread(value, wanted, plan.skipped, manifest, rank)
    if problems:
        raise IncompatibleStateError(storage.root, problems)
    with load_errors(storage.root):
        run_reads(storage, plan_tasks(plan.reads, find), threads)
    for finalize in plan.finalizers:  # numpy scalars and tuples take their slots once read
        finalize()


def _unread(
    value: Any, keys: Sequence[str], skipped: list[str], manifest: Manifest, rank: int | None
) -> list[StateMismatch]:
    """Each key asked for that is per-rank state without a valid rank, or not stored."""
    problems = []
    for key in keys:
        per_rank = [
            p for p in skipped if key == p or key.startswith(p + "/") or p.startswith(key + "/")
        ]
        if per_rank:
            ranks = sorted(manifest.rank_local)
            problems.append(
                StateMismatch(
                    key,
                    f"per-rank state (at {per_rank[0]!r}) asked for with rank={rank}; the "
                    f"checkpoint holds per-rank state of ranks {ranks}: pass one as rank=",
                )
            )
        elif not _planned(value, key):
            problems.append(StateMismatch.missing(key))
    return problems


def _planned(value: Any, key: str) -> bool:
    """Whether the structure built holds ``key`` (a sequence is read whole)."""
    node = value
    for part in key.split("/"):
        if isinstance(node, dict):
            match = [k for k in node if escape_component(k) == part]
            if not match:
                return False
            node = node[match[0]]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return isinstance(node, (list, tuple))  # a sequence is read whole
    return True
