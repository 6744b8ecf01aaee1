"""A save as its steps: agree on a plan -> clear the target -> stage -> persist -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.collective.exchange import AgreedPlan, exchange_plan, local_metas
from snapstate.collective.replica_check import WitnessHasher
from snapstate.engine.commit import (
    MARKERS,
    Arrival,
    encode_manifest,
    finish_rank,
    marker_chunk,
    marker_path,
    report_failure,
    write_marker,
)
from snapstate.engine.compress import chunk_key
from snapstate.engine.gcpause import paused as gc_paused
from snapstate.engine.handle import SaveHandle, SaveResult
from snapstate.engine.options import SaveOptions
from snapstate.engine.persist import PersistStats, RankWriter, as_checkpoint_error
from snapstate.engine.reuse import with_references
from snapstate.engine.stageplan import Run, Single, single_run, stage_steps, witness_steps
from snapstate.engine.staging import (
    SMALL_CHUNK_BYTES,
    HostBufferPool,
    Stager,
)
from snapstate.errors import CheckpointExistsError
from snapstate.format.manifest import MANIFEST, is_reference
from snapstate.format.marker import LocalTensor, Marker
from snapstate.planning.items import ItemMeta, PlacedItem, Placement, RankPlan, WriteItem
from snapstate.planning.replicas import witnessed_by
from snapstate.state.dtensor import item_meta, source_view
from snapstate.state.flatten import FlatState, flatten_state
from snapstate.state.views import StagedBytes, row_pieces
from snapstate.storage.base import Storage
from snapstate.storage.claim import Claim, claim_target


class SaveMode(Enum):
    """Whether the caller waits for the commit or only for the staging copies."""

    BLOCKING = "blocking"  # write straight from the caller's memory; return once committed
    ASYNC = "async"  # copy into host buffers; persist and commit in the background


def start_save(
    state: Any,
    storage: Storage,
    coord: Coordinator,
    *,
    pool: HostBufferPool | None,
    step: int | None,
    options: SaveOptions,
    mode: SaveMode | None = None,
) -> SaveHandle:
    """Run a save's foreground steps; the handle's background work persists and commits.

    ``mode`` defaults to ASYNC when a staging ``pool`` is given, BLOCKING otherwise.
    """
    if mode is None:
        mode = SaveMode.BLOCKING if pool is None else SaveMode.ASYNC
    return SaveJob(state, storage, coord, mode=mode, pool=pool, step=step, options=options).run()


@dataclass(frozen=True)
class Planned:
    """What ``agree`` hands on: the plan every rank agreed on, and this rank's share of it."""

    agreed: AgreedPlan
    rank_plan: RankPlan


@dataclass(frozen=True)
class Cleared:
    """The plan once the target holds no committed checkpoint to clobber: ``stage`` takes it."""

    planned: Planned


@dataclass(frozen=True)
class Staged:
    """What ``stage`` hands on: the writer holding this rank's chunks, the witnesses' hasher."""

    planned: Planned
    writer: RankWriter
    hasher: WitnessHasher | None
    blocking_s: float


@dataclass(frozen=True)
class Persisted:
    """What ``persist`` hands to ``commit``: this rank's marker is written."""

    planned: Planned
    arrival: Arrival
    blocking_s: float
    persist_s: float


class SaveJob:
    """One rank's part of one save; each step takes what the step before it returned."""

    def __init__(
        self,
        state: Any,
        storage: Storage,
        coord: Coordinator,
        *,
        mode: SaveMode,
        pool: HostBufferPool | None,
        step: int | None,
        options: SaveOptions,
    ) -> None:
        if mode is SaveMode.ASYNC and pool is None:
            raise ValueError("an async save needs a staging pool")
        if options.incremental is not None and step is None:  # its references name steps
            raise ValueError(
                "an incremental save needs its step: use CheckpointManager(incremental=True)"
            )
        self.state = state
        self.storage = storage
        self.coord = coord
        self.mode = mode
        self.pool = pool if mode is SaveMode.ASYNC else None
        self.step = step
        self.options = options
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.claim: Claim | None = None  # rank 0's hold on the target while this save writes

    def run(self) -> SaveHandle:
        """The foreground steps; a blocking save also persists and commits before returning."""
        try:
            with gc_paused():  # see engine/gcpause.py: no full collection inside the stall
                planned = self.agree()
                cleared = self.clear_target(planned)
                started = time.perf_counter()
                self.timings["clear_s"] = started - self.started - self.timings["plan_s"]
                staged = self.stage(cleared)
                self.timings["stage_s"] = time.perf_counter() - started
                if self.mode is SaveMode.BLOCKING:
                    return SaveHandle(result=self.finish(staged))
        except BaseException as exc:
            self._release_claim()
            if isinstance(exc, OSError):
                raise as_checkpoint_error(exc, self.storage.root) from exc
            raise
        return SaveHandle(run=lambda: self.finish(staged))

    def finish(self, staged: Staged) -> SaveResult:
        """The steps after staging: in the background of an async save."""
        try:
            return self.commit(self.persist(staged))
        except OSError as exc:  # disk full, read-only...: a CheckpointError, errno and path kept
            raise as_checkpoint_error(exc, self.storage.root) from exc
        finally:
            self._release_claim()

    def _release_claim(self) -> None:
        claim, self.claim = self.claim, None
        if claim is not None:
            claim.release()

    # -- steps -------------------------------------------------------------------------
    def agree(self) -> Planned:
        """Flatten the state, exchange metadata and agree on the plan (cached while unchanged)."""

        def local() -> tuple[FlatState, list[ItemMeta]]:
            flat = flatten_state(self.state)  # first: an unsaveable state touches nothing
            if self.coord.rank == 0:
                # one save writes a directory at a time (storage/claim.py): without overwrite
                # a second one is refused, with overwrite it waits, so the last commit wins
                overwrite = self.options.overwrite
                self.claim = claim_target(self.storage, overwrite, self.options.timeout)
            if self.coord.rank == 0 and not self.options.overwrite:
                # before this rank's offer: no rank writes before every offer is in, and
                # without overwrite the clearing removes only an unfinished save's leftovers
                _clear_target(self.storage, overwrite=False)
            if unchecked := self.options.unchecked_replicas:  # written from rank 0, unchecked
                flat.rank0_keys.update(k for k in flat.tensors if under_any(k, unchecked))
            return flat, local_metas(self.coord, flat, _item_metas)

        started = time.perf_counter()
        agreed = exchange_plan(self.coord, local, self.options.plan, self.options.timeout)
        self.timings["plan_s"] = time.perf_counter() - started
        self.timings["plan_cached"] = float(agreed.cached)
        return Planned(agreed, agreed.plan.for_rank(self.coord.rank))

    def clear_target(self, planned: Planned) -> Cleared:
        """Rank 0 refuses a committed target (unless overwriting) and removes leftovers.

        Without ``overwrite`` this was done within ``agree``, before rank 0's offer: it removes
        nothing committed, and the exchange is the gather that orders it before any write.
        Overwriting waits until the plan is agreed, so that an unsaveable state on any rank
        uncommits nothing; every rank waits for it (a gather), so no rank writes a shard rank 0
        then removes.
        """
        storage, overwrite = self.storage, self.options.overwrite
        if overwrite:

            def clear() -> None:
                if self.coord.rank == 0:
                    _clear_target(storage, overwrite)

            gather_or_raise(self.coord, clear, self.options.timeout)
        return Cleared(planned)

    def stage(self, cleared: Cleared) -> Staged:
        """Copy (async) or expose (blocking) this rank's chunks and hand them to the writer."""
        planned, options = cleared.planned, self.options
        writer: RankWriter | None = None
        try:
            writer = RankWriter(
                self.storage,
                planned.rank_plan,
                options.block_bytes,
                options.threads,
                hold=self.mode is SaveMode.ASYNC,
                compression=options.compression,
                reuse=options.incremental,
            )
            stager = Stager(self.pool, options.timeout, before_wait=writer.flush)
            piece_bytes = self._piece_bytes()
            # an async save copies every chunk anyway: runs take any chunk that fits a slab
            run_chunk_bytes = piece_bytes if self.pool is not None else SMALL_CHUNK_BYTES
            hasher, on_device = self._start_witnesses(planned.agreed)
            flat = planned.agreed.flat
            _stage_all(flat, planned.rank_plan, writer, stager, piece_bytes, run_chunk_bytes)
            self._finish_witnesses(flat, stager, hasher, on_device)
            stager.finish()
        except BaseException as exc:
            self._fail(planned, exc, writer)
            raise
        return Staged(planned, writer, hasher, time.perf_counter() - self.started)

    def persist(self, staged: Staged) -> Persisted:
        """Wait for the writes, fsync, then write this rank's marker."""
        planned, agreed = staged.planned, staged.planned.agreed
        prepared: list[tuple[Arrival, bytes]] = []

        def prepare_marker(stats: PersistStats) -> None:  # while the shards fsync
            marker = self._marker(staged, stats)
            tree, manifest = agreed.flat.tree, None
            if self.coord.world_size == 1:  # its own marker is all the manifest needs
                manifest = encode_manifest(agreed.plan, [marker], tree, self.step)
            arrival = Arrival(agreed.save_id, agreed.plan, tree, self.step, marker, manifest)
            prepared.append((arrival, marker.to_json()))

        try:
            staged.writer.close(meanwhile=prepare_marker)
            self.storage.sync_dir("shards")
            arrival, encoded = prepared[0]
            write_marker(self.storage, self.coord.rank, arrival.marker, encoded)
        except BaseException as exc:
            self._fail(planned, exc, staged.writer)
            raise
        persist_s = time.perf_counter() - self.started - staged.blocking_s
        return Persisted(planned, arrival, staged.blocking_s, persist_s)

    def commit(self, persisted: Persisted) -> SaveResult:
        """Arrive at the commit barrier; rank 0 assembles and publishes the manifest."""
        try:
            commit_s = finish_rank(
                self.coord, self.storage, persisted.arrival, self.options.timeout
            )
        except BaseException:
            _discard(self.storage, self.coord.rank, persisted.planned.rank_plan)
            raise
        return self._result(persisted, commit_s)

    # -- helpers -----------------------------------------------------------------------
    def _start_witnesses(self, agreed: AgreedPlan) -> tuple[WitnessHasher | None, list[WriteItem]]:
        """Start hashing this rank's copy of the chunks it witnesses, where it lies in host
        memory, on a background thread while this one stages its own share.

        Why not stage them like the written chunks: hashing reads the bytes once, where a copy
        reads and writes them and its hash reads them again. Returns the hasher (None: no
        witnesses) and the witnessed chunks on a device: an async save stages those and hashes
        the copies afterwards.
        """
        options = self.options
        if options.verify_replicas != "hash" or self.coord.world_size == 1 or not agreed.replicas:
            return None, []
        items = witnessed_by(
            agreed.witness, self.coord.rank, agreed.turn, options.replica_witnesses
        )
        hasher = WitnessHasher(options.block_bytes)
        on_device = []
        with torch.no_grad():
            for item in items:
                source = _source(agreed.flat, item)
                if hashed_where_it_lies(source, self.mode):
                    hasher.submit(item.name, source, last=True)
                else:
                    on_device.append(item)
        return hasher, on_device

    def _finish_witnesses(
        self,
        flat: FlatState,
        stager: Stager,
        hasher: WitnessHasher | None,
        on_device: list[WriteItem],
    ) -> None:
        """An async save waits until the host chunks are hashed (training may change them once
        it returns) and stages the device ones; a blocking save lets the hasher run on."""
        if hasher is None:
            return
        hashed = hasher.mark() if self.mode is SaveMode.ASYNC else None
        try:
            if on_device:
                with torch.no_grad():
                    _stage_witness_copies(flat, on_device, hasher, stager, self._piece_bytes())
        finally:
            hasher.close()
        if hashed is not None:
            hashed.wait()

    def _piece_bytes(self) -> int:
        # Pieces no larger than a slab: an oversized piece would take a one-off slab each save.
        if self.pool is not None:
            return min(self.options.piece_bytes, self.pool.slab_bytes)
        return self.options.piece_bytes

    def _fail(self, planned: Planned, exc: BaseException, writer: RankWriter | None) -> None:
        """Tell the others this rank will not arrive, and drop what it wrote."""
        report_failure(self.coord, planned.agreed.save_id, exc)
        if writer is not None:
            writer.abort()
        _discard(self.storage, self.coord.rank, planned.rank_plan)

    def _marker(self, staged: Staged, stats: PersistStats) -> Marker:
        hasher = staged.hasher
        replicas = hasher.result() if hasher is not None else {}
        if hasher is not None:
            self.timings["replica_check_s"] = hasher.seconds
        marker = _marker(
            self.coord.rank,
            staged.planned,
            stats,
            self.options.block_bytes,
            staged.blocking_s,
            replicas,
        )
        reuse = self.options.incremental
        return (
            marker
            if reuse is None
            else with_references(marker, staged.planned.rank_plan, stats, reuse)
        )

    def _result(self, persisted: Persisted, commit_s: float) -> SaveResult:
        rank_plan = persisted.planned.rank_plan
        written = rank_plan.nbytes
        files = [f.path for f in rank_plan.files]
        if self.options.incremental is not None:  # what this save wrote, not what it references
            own = persisted.arrival.marker.files
            files = [f for f in own if not is_reference(f)]
            written = sum(own[f] for f in files)
        return SaveResult(
            path=self.storage.root,
            step=self.step,
            rank=self.coord.rank,
            world_size=self.coord.world_size,
            bytes_written=written,
            files=files,
            blocking_s=persisted.blocking_s,
            persist_s=persisted.persist_s,
            commit_s=commit_s,
            total_s=time.perf_counter() - self.started,
            timings=self.timings,
        )


def under_any(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of the key paths ``prefixes`` or lies under one of them."""
    return any(key == p or key.startswith(p.rstrip("/") + "/") for p in prefixes)


def _discard(storage: Storage, rank: int, rank_plan: RankPlan) -> None:
    """Remove what this rank wrote for a save that will not commit (shards, marker).

    Best effort: the save's own error is the one to report, and a manager removes any
    leftovers of uncommitted saves when it starts.
    """
    try:
        # the failure came after the commit point: keep the checkpoint
        if storage.exists(MANIFEST):
            return
        for f in rank_plan.files:
            storage.remove(f.path)
        storage.remove(marker_path(rank))
        if rank == 0:
            storage.remove_tree(MARKERS)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


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
    storage.remove_tree(MARKERS)
    storage.makedirs("shards")


def _item_metas(flat: FlatState) -> list[ItemMeta]:
    metas = [
        item_meta(k, t, rank_local=False, from_rank0=k in flat.rank0_keys)
        for k, t in flat.tensors.items()
    ]
    metas += [item_meta(k, t, rank_local=True) for k, t in flat.rank_local_tensors.items()]
    return metas


def _stage_all(
    flat: FlatState,
    rank_plan: RankPlan,
    writer: RankWriter,
    stager: Stager,
    piece_bytes: int,
    run_chunk_bytes: int,
) -> None:
    """Stage every chunk of the plan: runs by one batched copy each, large chunks in pieces."""
    with torch.no_grad():
        for step in stage_steps(rank_plan, piece_bytes, run_chunk_bytes):
            if isinstance(step, Single):
                _stage_single(
                    step.placed, _source(flat, step.placed.item), writer, stager, piece_bytes
                )
                continue
            views = _run_sources(flat, step)
            if step.batchable and stager.runnable(views):
                staged = stager.stage_run(views, step.layout, step.placed[0].start)
                writer.submit_run(step.parts, staged)
                continue
            for placed, view in zip(step.placed, views):  # mixed devices, strides, dtypes
                _stage_single(placed, view, writer, stager, piece_bytes)


def _run_sources(flat: FlatState, run: Run) -> list[torch.Tensor]:
    """The run's tensors as it copies them: looked up by key while they are whole plain
    tensors (the common case), retyped where the run copies their bits as integers."""
    views: list[torch.Tensor] | None = None
    if run.keys is not None:
        tensors = flat.rank_local_tensors if run.rank_local else flat.tensors
        views = [tensors[k] for k in run.keys]
        if not all(type(v) is torch.Tensor or type(v) is torch.nn.Parameter for v in views):
            views = None
    if views is None:
        views = [_source(flat, p.item) for p in run.placed]
    for i in run.retyped:
        views[i] = views[i].view(run.layout.dtypes[i])
    return views


def _stage_single(
    placed: PlacedItem, view: torch.Tensor, writer: RankWriter, stager: Stager, piece_bytes: int
) -> None:
    """One chunk alone: a run of one when it is small and plain, else in pieces."""
    small = 0 < placed.item.nbytes <= min(SMALL_CHUNK_BYTES, piece_bytes)
    if small and stager.batchable(view):
        run = single_run(placed)
        writer.submit_run(run.parts, stager.stage_run([view], run.layout, placed.start))
    else:
        _stage_pieces(placed, view, writer, stager, piece_bytes)


def hashed_where_it_lies(source: torch.Tensor, mode: SaveMode) -> bool:
    """Whether a witnessed chunk is hashed from the caller's memory: in a blocking save
    always, in an async save when it is in host memory (a device's bytes are staged first)."""
    return mode is SaveMode.BLOCKING or source.device.type == "cpu"


def _stage_witness_copies(
    flat: FlatState, items: list[WriteItem], hasher: WitnessHasher, stager: Stager, piece_bytes: int
) -> None:
    """Snapshot the witnessed chunks like the written ones: runs by batched copies, the rest
    in pieces; the hasher hashes them once staging ends."""
    for step in witness_steps(items, piece_bytes):
        if isinstance(step, Run):
            views = _run_sources(flat, step)
            if step.batchable and stager.runnable(views):
                parts = [(p.item.name, begin, end) for p, begin, end, _ in step.parts]
                staged = stager.stage_run(views, step.layout)
                assert isinstance(staged, StagedBytes)  # an async save copies what it stages
                hasher.submit_run(parts, staged)
                continue
            chunks = list(zip(step.placed, views))
        else:
            chunks = [(step.placed, _source(flat, step.placed.item))]
        for placed, view in chunks:
            pieces = list(row_pieces(view, piece_bytes))
            for i, (_, rows) in enumerate(pieces):
                hasher.submit(placed.item.name, stager.stage(rows), i == len(pieces) - 1)


def _source(flat: FlatState, item: WriteItem) -> torch.Tensor:
    tensors = flat.rank_local_tensors if item.placement is Placement.RANK_LOCAL else flat.tensors
    t = tensors[item.key]
    # the common case, a whole plain tensor: no slicing (a view per tensor costs microseconds)
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        if t.shape == item.box.sizes and not any(item.box.offsets):
            return t
    return source_view(t, item.box)


def _stage_pieces(
    placed: PlacedItem, view: torch.Tensor, writer: RankWriter, stager: Stager, piece_bytes: int
) -> None:
    pieces = list(row_pieces(view, piece_bytes))
    for i, (offset, rows) in enumerate(pieces):
        staged = stager.stage(rows, placed.start + offset)
        writer.submit(placed, offset, staged, last=i == len(pieces) - 1)


def _marker(
    rank: int,
    planned: Planned,
    stats: PersistStats,
    block_bytes: int,
    blocking_s: float,
    replicas: dict[str, tuple[str, ...]],
) -> Marker:
    agreed, rank_plan = planned.agreed, planned.rank_plan
    flat = agreed.flat
    chunks = tuple(
        marker_chunk(
            p, block_bytes, stats.digests[(p.file, p.start, p.end)], stats.stored.get(chunk_key(p))
        )
        for f in rank_plan.files
        for p in f.items
    )
    local_tensors = {
        k: LocalTensor(m.dtype, tuple(m.shape), flat.kinds[k])
        for k, m in ((k, item_meta(k, t, True)) for k, t in flat.rank_local_tensors.items())
    }
    return Marker(
        rank=rank,
        files={f.path: stats.file_sizes.get(f.path, f.size) for f in rank_plan.files},
        chunks=chunks,
        kinds={k: flat.kinds[k] for k in flat.tensors},
        local_trees=flat.rank_local_trees,
        local_tensors=local_tensors,
        timings={"blocking_s": blocking_s, "write_s": stats.write_s, "bytes": rank_plan.nbytes},
        tree=flat.tree if agreed.tree_differs else None,
        replicas=replicas,
    )
