"""A save, end to end: flatten -> gather metadata -> plan -> stage -> persist -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator
from snapstate.collective.exchange import exchange_plan
from snapstate.collective.replica_check import ReplicaHasher
from snapstate.engine.commit import (
    MARKERS,
    finish_rank,
    marker_chunk,
    marker_path,
    report_failure,
    write_marker,
)
from snapstate.engine.handle import SaveHandle, SaveResult
from snapstate.engine.persist import PersistStats, RankWriter
from snapstate.engine.staging import DEFAULT_SLAB_BYTES, HostBufferPool, Stager, row_pieces
from snapstate.errors import CheckpointExistsError
from snapstate.format.integrity import DEFAULT_BLOCK_BYTES
from snapstate.format.manifest import MANIFEST
from snapstate.planning.items import ItemMeta, Placement, RankPlan
from snapstate.planning.layout import PlanOptions, SavePlan
from snapstate.planning.replicas import ReplicaGroup
from snapstate.state.dtensor import item_meta, source_view
from snapstate.state.flatten import FlatState, flatten_state
from snapstate.storage.base import Storage


@dataclass(frozen=True)
class SaveOptions:
    timeout: float = 1800.0  # seconds to wait for other ranks or for staging memory
    block_bytes: int = DEFAULT_BLOCK_BYTES  # one xxh3 checksum per block
    piece_bytes: int = DEFAULT_SLAB_BYTES  # unit of staging and writing
    threads: int = 1  # writer threads per rank (files are spread over them)
    overwrite: bool = False  # replace a committed checkpoint at the same path
    plan: PlanOptions = field(default_factory=PlanOptions)
    verify_replicas: str = (
        "hash"  # "hash": replicas must hash equal across ranks (checked at save); "off"
    )


@dataclass
class _Prepared:
    flat: FlatState
    plan: SavePlan
    save_id: str
    tree_differs: bool = False  # this rank's structure differs from rank 0's: its marker carries it
    timings: dict[str, float] = field(default_factory=dict)
    # boxes several ranks hold, compared at commit
    replicas: list[ReplicaGroup] = field(default_factory=list)
    hasher: ReplicaHasher | None = None


def start_save(
    state: Any,
    storage: Storage,
    coord: Coordinator,
    *,
    pool: HostBufferPool | None,
    step: int | None,
    options: SaveOptions,
) -> SaveHandle:
    """Blocking part of a save; returns a handle whose background work persists and commits.

    ``pool=None`` means a blocking save: CPU tensors are written straight from their memory.
    """
    started = time.perf_counter()
    prepared = _prepare(state, storage, coord, options)
    rank_plan = prepared.plan.for_rank(coord.rank)
    try:
        writer = RankWriter(
            storage, rank_plan, options.block_bytes, options.threads, hold=pool is not None
        )
        # Pieces no larger than a slab: an oversized piece would take a one-off slab each save.
        piece_bytes = (
            min(options.piece_bytes, pool.slab_bytes) if pool is not None else options.piece_bytes
        )
        _stage_all(
            prepared.flat,
            rank_plan,
            writer,
            Stager(pool, options.timeout, before_wait=writer.flush),
            piece_bytes,
        )
        if pool is not None and prepared.hasher is not None:
            prepared.hasher.result()  # the values of the call: the caller may change them once we return
    except BaseException as exc:
        report_failure(coord, prepared.save_id, exc)
        if "writer" in locals():
            writer.abort()
        raise
    blocking_s = time.perf_counter() - started

    def persist_and_commit() -> SaveResult:
        try:
            stats = writer.close()
            storage.sync_dir("shards")
            write_marker(
                storage,
                coord.rank,
                _marker(coord.rank, prepared, rank_plan, stats, options, blocking_s),
            )
        except BaseException as exc:
            report_failure(coord, prepared.save_id, exc)
            _discard(storage, coord.rank, rank_plan)
            raise
        persist_s = time.perf_counter() - started - blocking_s
        try:
            commit_s = finish_rank(
                coord,
                storage,
                prepared.save_id,
                prepared.plan,
                prepared.flat.tree,
                step,
                options.timeout,
                prepared.replicas,
            )
        except BaseException:
            _discard(storage, coord.rank, rank_plan)
            raise
        return SaveResult(
            path=storage.root,
            step=step,
            rank=coord.rank,
            world_size=coord.world_size,
            bytes_written=rank_plan.nbytes,
            files=[f.path for f in rank_plan.files],
            blocking_s=blocking_s,
            persist_s=persist_s,
            commit_s=commit_s,
            total_s=time.perf_counter() - started,
            timings=prepared.timings,
        )

    if pool is None:
        return SaveHandle(result=persist_and_commit())
    return SaveHandle(run=persist_and_commit)


def _discard(storage: Storage, rank: int, rank_plan: RankPlan) -> None:
    """Remove what this rank wrote for a save that will not commit (shards, marker).

    Best effort: the save's own error is the one to report, and a manager removes any
    leftovers of uncommitted saves when it starts.
    """
    try:
        if storage.exists(MANIFEST):  # the failure came after the commit point: keep the checkpoint
            return
        for f in rank_plan.files:
            storage.remove(f.path)
        storage.remove(marker_path(rank))
        if rank == 0:
            storage.remove_tree(MARKERS)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _prepare(state: Any, storage: Storage, coord: Coordinator, options: SaveOptions) -> _Prepared:
    def local() -> tuple[FlatState, list[ItemMeta]]:
        # first: an unsaveable state must not uncommit the old checkpoint
        flat = flatten_state(state)
        if coord.rank == 0:
            _clear_target(storage, options.overwrite)
        return flat, _item_metas(flat)

    started = time.perf_counter()
    # every rank: the same plan, cached while unchanged
    agreed = exchange_plan(coord, local, options.plan)
    timings = {"plan_s": time.perf_counter() - started, "plan_cached": float(agreed.cached)}
    check = options.verify_replicas == "hash" and coord.world_size > 1 and bool(agreed.replicas)
    # overlaps staging and writes
    hasher = ReplicaHasher(agreed.flat, agreed.replicas, coord.rank) if check else None
    return _Prepared(
        agreed.flat,
        agreed.plan,
        agreed.save_id,
        agreed.tree_differs,
        timings,
        agreed.replicas if check else [],
        hasher,
    )


def _clear_target(storage: Storage, overwrite: bool) -> None:
    """Refuse to clobber a committed checkpoint; remove leftovers of an interrupted save."""
    if storage.exists(MANIFEST):
        if not overwrite:
            raise CheckpointExistsError(
                f"{storage.root} already holds a committed checkpoint (pass overwrite=True to replace it)"
            )
        storage.remove(MANIFEST)  # uncommit first: a crash below leaves no torn checkpoint
        storage.sync_dir()
    storage.remove_tree("shards")
    storage.remove_tree(".markers")
    storage.makedirs("shards")


def _item_metas(flat: FlatState) -> list[ItemMeta]:
    metas = [
        item_meta(k, t, rank_local=False, from_rank0=k in flat.rank0_keys)
        for k, t in flat.tensors.items()
    ]
    metas += [item_meta(k, t, rank_local=True) for k, t in flat.rank_local_tensors.items()]
    return metas


def _stage_all(
    flat: FlatState, rank_plan: RankPlan, writer: RankWriter, stager: Stager, piece_bytes: int
) -> None:
    with torch.no_grad():
        for file in rank_plan.files:
            for placed in file.items:
                item = placed.item
                tensors = (
                    flat.rank_local_tensors
                    if item.placement is Placement.RANK_LOCAL
                    else flat.tensors
                )
                view = source_view(tensors[item.key], item.box)
                pieces = list(row_pieces(view, piece_bytes))
                for i, (offset, rows) in enumerate(pieces):
                    writer.submit(placed, offset, stager.stage(rows), last=i == len(pieces) - 1)
    stager.finish()


def _marker(
    rank: int,
    prepared: _Prepared,
    rank_plan: RankPlan,
    stats: PersistStats,
    options: SaveOptions,
    blocking_s: float,
) -> dict[str, Any]:
    flat = prepared.flat
    chunks = [
        marker_chunk(p, options.block_bytes, stats.digests[(p.file, p.start, p.end)])
        for f in rank_plan.files
        for p in f.items
    ]
    local_tensors = {
        k: {"dtype": m.dtype, "shape": list(m.shape), "kind": flat.kinds[k]}
        for k, m in ((k, item_meta(k, t, True)) for k, t in flat.rank_local_tensors.items())
    }
    replicas = prepared.hasher.result() if prepared.hasher is not None else {}
    if prepared.hasher is not None:
        prepared.timings["replica_check_s"] = prepared.hasher.seconds
    return {
        **({"tree": flat.tree} if prepared.tree_differs else {}),
        **({"replicas": {str(i): h for i, h in replicas.items()}} if replicas else {}),
        "rank": rank,
        "files": {f.path: f.size for f in rank_plan.files},
        "chunks": chunks,
        "kinds": {k: flat.kinds[k] for k in flat.tensors},
        "rank_local": {"trees": flat.rank_local_trees, "tensors": local_tensors},
        "timings": {"blocking_s": blocking_s, "write_s": stats.write_s, "bytes": rank_plan.nbytes},
    }
