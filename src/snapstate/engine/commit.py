"""Commit: per-rank markers, then the coordinator assembles and publishes the manifest.

A rank's marker lists what it wrote (chunks with checksums) and is written only after its
shard files are fsynced. The coordinator commits only when every rank has reported success;
a missing or failed rank means no manifest and an error on every rank.
"""

from __future__ import annotations

import datetime as _dt
import platform
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from snapstate._version import __version__
from snapstate.collective.barrier import OK, StoreBarrier, describe, raise_for
from snapstate.collective.coordinator import Coordinator
from snapstate.collective.replica_check import check_witnesses
from snapstate.engine.compress import StoredChunk
from snapstate.errors import CheckpointError
from snapstate.format.manifest import (
    MANIFEST,
    ChunkRecord,
    CompressedChunk,
    DigestChunk,
    FileRecord,
    Manifest,
    RankLocalRecord,
    TensorRecord,
)
from snapstate.format.marker import Marker, MarkerChunk, parse_marker
from snapstate.planning.items import ItemMeta, PlacedItem
from snapstate.planning.layout import SavePlan
from snapstate.planning.trees import merge_trees
from snapstate.storage.base import Storage

MARKERS = ".markers"


def marker_path(rank: int) -> str:
    return f"{MARKERS}/r{rank:05d}.json"


def marker_chunk(
    p: PlacedItem, block_bytes: int, xxh3: list[str], stored: StoredChunk | None = None
) -> MarkerChunk:
    """How a rank's marker reports one chunk it wrote (``stored``: where its compressed
    frames lie instead, and ``xxh3`` the checksums of its raw bytes)."""
    if stored is not None:
        return replace(
            marker_chunk(p, block_bytes, list(stored.xxh3)),
            start=stored.start,
            end=stored.end,
            codec=stored.codec,
            frames=stored.frames,
            raw_xxh3=tuple(xxh3) if stored.codec else (),
        )
    return MarkerChunk(
        key=p.item.key,
        placement=p.item.placement.value,
        file=p.file,
        name=p.item.name,
        start=p.start,
        end=p.end,
        offsets=tuple(p.item.box.offsets),
        sizes=tuple(p.item.box.sizes),
        block_bytes=block_bytes,
        xxh3=tuple(xxh3),
    )


def write_marker(storage: Storage, rank: int, marker: Marker, encoded: bytes | None = None) -> None:
    """``encoded``: the marker's JSON when the caller already made it."""
    storage.write_atomic(marker_path(rank), encoded if encoded is not None else marker.to_json())


def read_markers(storage: Storage, world_size: int, own: Marker | None = None) -> list[Marker]:
    """Every rank's marker, validated (CorruptCheckpointError naming the marker otherwise).

    ``own`` is the reading rank's marker, still in memory: its file need not be parsed.
    """
    markers = []
    for r in range(world_size):
        if own is not None and own.rank == r:
            markers.append(own)
            continue
        path = marker_path(r)
        markers.append(parse_marker(storage.read_bytes(path), f"{storage.root}/{path}", r))
    return markers


def assemble_manifest(
    plan: SavePlan,
    markers: list[Marker],
    tree: dict[str, Any],
    step: int | None,
    timings: dict[str, Any],
) -> Manifest:
    """Pure: the manifest from the plan and what every rank reported."""
    # ranks whose structure differs
    tree = merge_trees(tree, [m.tree for m in markers if m.tree is not None])
    tensors = {
        key: _record(meta, markers[0].kinds.get(key, "tensor")) for key, meta in plan.metas.items()
    }
    rank_local: dict[int, RankLocalRecord] = {}
    files: dict[str, FileRecord] = {}
    for marker in markers:
        local = RankLocalRecord(marker.local_trees, {})
        for key, info in marker.local_tensors.items():
            local.tensors[key] = TensorRecord(
                info.dtype, list(info.shape), info.kind, "rank_local", []
            )
        for path, size in marker.files.items():
            files[path] = FileRecord(size, marker.rank)
        for c in marker.chunks:
            record = _chunk_record(c)
            (local.tensors if c.placement == "rank_local" else tensors)[c.key].chunks.append(record)
        if local.trees or local.tensors:
            rank_local[marker.rank] = local
    for rec in [*tensors.values(), *(t for r in rank_local.values() for t in r.tensors.values())]:
        rec.chunks.sort(key=lambda c: c.offsets)
    per_rank = [sum(m.files.values()) for m in markers]
    return Manifest(
        tree=tree,
        tensors=tensors,
        rank_local=rank_local,
        files=files,
        world_size=len(markers),
        step=step,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        versions=_versions(),
        totals={
            "bytes": sum(per_rank),
            "tensor_bytes": sum(c.end - c.start for m in markers for c in m.chunks),
            "bytes_per_rank": per_rank,
            "files": len(files),
        },
        timings={**timings, "per_rank": [m.timings for m in markers]},
    )


def _chunk_record(c: MarkerChunk) -> ChunkRecord:
    fields = (list(c.offsets), list(c.sizes), c.file, c.name, c.start, c.end, c.block_bytes)
    if c.codec is None and c.digest is not None:
        return DigestChunk(*fields, list(c.xxh3), c.digest)
    if c.codec is None:
        return ChunkRecord(*fields, list(c.xxh3))
    return CompressedChunk(*fields, list(c.xxh3), c.codec, [list(f) for f in c.frames])


def encode_manifest(
    plan: SavePlan, markers: list[Marker], tree: dict[str, Any], step: int | None
) -> bytes:
    """The manifest's bytes, ready to publish."""
    return assemble_manifest(plan, markers, tree, step, {"commit_started": time.time()}).to_json()


def _record(meta: ItemMeta, kind: str) -> TensorRecord:
    return TensorRecord(meta.dtype, list(meta.shape), kind, meta.placement.value, [])


def _versions() -> dict[str, str]:
    return {
        "snapstate": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class Arrival:
    """What a rank brings to the commit, once its shards are fsynced and its marker written."""

    save_id: str
    plan: SavePlan
    tree: dict[str, Any]
    step: int | None
    marker: Marker  # this rank's own, still in memory: the coordinator need not parse its file
    # a single rank's manifest, encoded from ``marker`` while its shards fsynced
    # (``encode_manifest``); with more ranks the coordinator encodes it from every marker
    manifest: bytes | None = None


def finish_rank(coord: Coordinator, storage: Storage, arrival: Arrival, timeout: float) -> float:
    """After this rank's marker is written: arrive, then commit (coordinator) or wait for the commit.

    Runs in the background of async saves, so it talks through the store (``StoreBarrier``),
    never a collective; a rank that does not arrive within ``timeout`` means no manifest and
    a CheckpointTimeoutError naming it on every other rank.
    """
    started = time.perf_counter()
    barrier = StoreBarrier(coord, arrival.save_id)
    barrier.arrive()
    if coord.rank != barrier.root:
        raise_for(barrier.wait_decision(timeout), f"checkpoint {storage.root}")
        return time.perf_counter() - started
    arrived: dict[int, str] = {}
    try:
        arrived = dict(enumerate(barrier.wait_arrivals(timeout)))
        failed = [f"rank {r}: {o}" for r, o in arrived.items() if o != OK]
        if failed:
            raise CheckpointError("not committed, a rank failed: " + "; ".join(failed))
        markers = read_markers(storage, coord.world_size, arrival.marker)
        # replicas that diverged: ReplicaMismatchError, no commit
        check_witnesses(markers)
        check_files(storage, markers)
        manifest = arrival.manifest
        if manifest is None or coord.world_size != 1:
            manifest = encode_manifest(arrival.plan, markers, arrival.tree, arrival.step)
        storage.write_atomic(MANIFEST, manifest)
        _recheck_files(storage, markers)
    except BaseException as exc:
        # the ranks waiting hear why
        barrier.decide(describe(exc), getattr(exc, "arrived", arrived), wait=timeout)
        raise
    try:  # committed: the markers are invisible leftovers now, and tidying them is no failure
        storage.remove_tree(MARKERS)
    except OSError:
        pass
    barrier.decide(OK, arrived, wait=timeout)  # return once every rank knows the outcome
    return time.perf_counter() - started


def check_files(storage: Storage, markers: list[Marker]) -> None:
    """Every shard the markers list is there, whole: else no commit (the root was deleted?).

    A stat per file, just before the manifest: without it, a directory removed during an async
    save would get a manifest whose shards are gone (the writes went to unlinked files).
    """
    for marker in markers:
        for path, size in marker.files.items():
            try:
                found = storage.size(path)
            except OSError:
                found = None
            if found != size:
                what = "is missing" if found is None else f"has {found} bytes, not {size}"
                raise CheckpointError(
                    f"not committed: shard {storage.root}/{path} of rank {marker.rank} {what}"
                    " (was the checkpoint directory deleted or changed during the save?)"
                )


def _recheck_files(storage: Storage, markers: list[Marker]) -> None:
    """The shards again, after the manifest: a root deleted between the first check and the
    write (which recreated the directory) leaves a manifest of shards that are gone. Then
    the manifest goes again and the save fails: it never reports success."""
    try:
        check_files(storage, markers)
    except CheckpointError:
        try:
            storage.remove(MANIFEST)
        except OSError:
            pass
        raise


def report_failure(coord: Coordinator, save_id: str, exc: BaseException) -> None:
    """Tell the coordinator this rank will not arrive, so it fails fast instead of timing out."""
    try:
        StoreBarrier(coord, save_id).arrive(describe(exc))
    except Exception:  # noqa: BLE001 - the store itself may be gone; the timeout then applies
        pass
