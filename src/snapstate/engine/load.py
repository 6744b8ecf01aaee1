"""Load: intersect target tensors with stored chunks, read only the bytes needed, verify, copy.

A chunk that a target holds whole and contiguously is read straight into the target's memory
(no extra copy); any other overlap reads the block-aligned span that covers it, verifies those
blocks, and copies the overlap out.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.collective.loadshare import fail_together
from snapstate.engine.chunkread import (
    ReadTask,
    load_errors,
    read_bytes,
    reads_whole_chunk,
    select,
    verify,
)
from snapstate.engine.decompress import any_compressed, read_compressed
from snapstate.engine.headers import ShardHeaders
from snapstate.engine.mapped import can_map, load_mapped
from snapstate.engine.readorder import DirectRead, read_in_file_order
from snapstate.engine.rollback import Rollback
from snapstate.engine.sharedread import shared_reads
from snapstate.engine.transport import (
    LoadFacts,
    LoadRoute,
    Transport,
    Undo,
    choose_route,
    gloo_backend,
)
from snapstate.errors import IncompatibleStateError, MismatchKind, SkippedKeys, StateMismatch
from snapstate.format.dtypes import dtype_from_name, empty_bytes
from snapstate.format.dtypes import itemsize as dtype_itemsize
from snapstate.format.manifest import Manifest, TensorRecord
from snapstate.planning.items import Box
from snapstate.planning.reshard import covering_span, local_slices, overlap
from snapstate.state.dtensor import local_box, local_data
from snapstate.state.restore import (
    ReadRequest,
    RestorePlan,
    StoredTensor,
    matches_nothing,
    plan_restore,
)
from snapstate.state.views import bits_view, byte_view
from snapstate.storage.base import Storage, capabilities

DEFAULT_READ_THREADS = 4


@dataclass
class LoadResult:
    """What a load did; ``skipped`` lists what a non-strict load left untouched."""

    path: str
    bytes_read: int = 0  # from storage, by this rank
    seconds: float = 0.0
    bytes_received: int = (
        0  # from other ranks that read shared bytes once for all (distributed loads)
    )
    skipped: SkippedKeys = field(default_factory=SkippedKeys)


def records_for(
    manifest: Manifest, rank: int | None, headers: ShardHeaders
) -> Callable[[str, bool], TensorRecord | None]:
    """The stored record of a key, each held to its shards' headers when first looked up:
    planning looks a tensor up before it allocates or reads anything for it."""
    local = manifest.rank_local.get(rank) if rank is not None else None

    def find(key: str, rank_local: bool) -> TensorRecord | None:
        if rank_local:
            record = local.tensors.get(key) if local else None
        else:
            record = manifest.tensors.get(key)
        if record is not None:
            headers.check(key, record)
        return record

    return find


def load_into(
    state: Any,
    storage: Storage,
    manifest: Manifest,
    rank: int | None,
    *,
    strict: bool,
    threads: int = DEFAULT_READ_THREADS,
    coord: Coordinator | None = None,
    read_once: bool | None = True,
    hosts: int = 1,
    rank_local_refusal: str | None = None,
    timeout: float | None = None,
) -> LoadResult:
    """Fill ``state`` in place. ``rank=None`` skips rank-local state, or refuses the
    rank-local keys the target asks for with ``rank_local_refusal`` as the reason.

    With a coordinator of several ranks the load is a collective: the ranks agree that every
    read succeeded, so a corrupt or refused checkpoint raises on every rank and leaves every
    rank's state as it was; ``timeout`` bounds each wait for the others. ``read_once`` and
    ``hosts`` (the machines the ranks span) choose whether shared bytes are read by one rank
    and sent on (``engine/transport.py``). The steps: plan, choose the route, move the bytes,
    finish (containers, Stateful objects), each undone if a later one fails.
    """
    started = time.perf_counter()
    group = coord if coord is not None and coord.world_size > 1 else None
    planned = _plan_or_fail(
        state, storage, manifest, rank, strict, rank_local_refusal, group, timeout
    )
    route = choose_route(_facts(planned, storage, manifest, group, read_once, hosts), timeout)
    rollback, waits = _undo(route.undo, planned)
    result = LoadResult(storage.root, skipped=skipped_keys(planned.plan))
    try:
        with load_errors(storage.root):
            _transfer(storage, planned.tasks, threads, group, route, result, waits)
    except BaseException:
        rollback.restore()  # a failed load leaves the caller's tensors as they were
        raise
    try:
        # after the reads: a corrupt checkpoint leaves the containers as they were; a
        # load_state_dict that raises leaves everything as it was (StateRestoreError)
        planned.plan.finish(rollback.restore, reads_undone=route.undo is not Undo.NOTHING)
    finally:
        rollback.discard()
    result.seconds = time.perf_counter() - started
    return result


@dataclass(frozen=True)
class _Planned:
    """A load's plan and the reads it takes: each request's tasks, and all of them."""

    plan: RestorePlan
    per_read: list[list[ReadTask]]
    tasks: list[ReadTask]


def _plan_or_fail(
    state: Any,
    storage: Storage,
    manifest: Manifest,
    rank: int | None,
    strict: bool,
    rank_local_refusal: str | None,
    group: Coordinator | None,
    timeout: float | None,
) -> _Planned:
    """The plan, or its error raised on every rank: the others are entering the load's
    first gather, and fail with it instead of waiting. Each tensor planned is first held
    to its shards' headers (one read per file), before anything is allocated for it."""
    try:
        find = records_for(manifest, rank, ShardHeaders(storage, manifest))
        plan = _plan(state, manifest, rank, find, strict, storage.root, rank_local_refusal)
        per_read = tasks_per_read(plan.reads, find)
    except Exception as exc:
        if group is not None:
            fail_together(group, exc, timeout)
        raise
    return _Planned(plan, per_read, [t for ts in per_read for t in ts])


def _facts(
    planned: _Planned,
    storage: Storage,
    manifest: Manifest,
    group: Coordinator | None,
    read_once: bool | None,
    hosts: int,
) -> LoadFacts:
    nbytes = sum(t.chunk.end - t.chunk.start for t in planned.tasks)
    return LoadFacts(
        ranks=group.world_size if group is not None else 1,
        hosts=hosts,
        gloo=group is None or gloo_backend(group),
        read_once=read_once,
        compressed=any_compressed(manifest),
        mappable=can_map(storage, nbytes),
        untrusted_stateful=planned.plan.untrusted_stateful(),
        cold_whole_chunks=lambda: _cold_whole_chunks(storage, planned.tasks),
    )


def _undo(undo: Undo, planned: _Planned) -> tuple[Rollback, list[Callable[[], None]] | None]:
    """The rollback the route asks for, and for copies made ahead each task's wait."""
    if undo is Undo.COPIES_AHEAD:
        return _rollback_ahead(planned.plan.reads, planned.per_read)
    return Rollback(planned.plan.reads if undo is Undo.COPIES else []), None


def skipped_keys(plan: RestorePlan) -> SkippedKeys:
    """What a non-strict load leaves untouched: keys the checkpoint lacks, and differences."""
    missing = [m.key for m in plan.mismatches if m.kind is MismatchKind.MISSING]
    return SkippedKeys(missing=missing, mismatched=plan.mismatches)


def _plan(
    state: Any,
    manifest: Manifest,
    rank: int | None,
    find: Callable[[str, bool], TensorRecord | None],
    strict: bool,
    root: str,
    rank_local_refusal: str | None = None,
) -> RestorePlan:
    rl_trees = (
        manifest.rank_local[rank].trees
        if rank is not None and rank in manifest.rank_local
        else ({} if rank is not None else None)
    )
    plan = plan_restore(state, manifest.tree, stored_lookup(find), rl_trees)
    problems = (
        [StateMismatch(key, rank_local_refusal, MismatchKind.REFUSED) for key in plan.skipped]
        if rank_local_refusal
        else []
    )
    problems += plan.mismatches if strict else []
    nothing = matches_nothing(state, manifest.tree)
    if problems or nothing:
        raise IncompatibleStateError(root, problems + ([nothing] if nothing else []))
    return plan


def _transfer(
    storage: Storage,
    tasks: list[ReadTask],
    threads: int,
    group: Coordinator | None,
    route: LoadRoute,
    result: LoadResult,
    waits: list[Callable[[], None]] | None = None,
) -> None:
    """Move the bytes by the route's transport (each task first calling its ``waits``
    entry); with several ranks, fail on all or none."""
    if route.transport is Transport.READ_ONCE and group is not None:
        # agrees on the reads' outcome itself, before any byte moves
        stats = shared_reads(group, storage, tasks, threads, timeout=route.timeout)
        result.bytes_read, result.bytes_received = stats.bytes_read, stats.bytes_received
        return
    if route.transport is Transport.MAPPED:
        # every rank's checks pass (a gather) before any rank writes a target
        result.bytes_read = load_mapped(storage, tasks, threads, _agreement(group, route.timeout))
        return

    def read_all() -> None:  # with several ranks an error here is raised on every rank
        result.bytes_read = run_reads(storage, tasks, threads, waits)

    if group is None:
        read_all()
    else:
        gather_or_raise(group, read_all, route.timeout)


def _agreement(
    group: Coordinator | None, timeout: float | None
) -> Callable[[Callable[[], None]], None] | None:
    """For several ranks: run a check here and raise any rank's failure on all of them."""
    if group is None:
        return None
    ranks = group

    def agree(check: Callable[[], None]) -> None:
        gather_or_raise(ranks, check, timeout)

    return agree


def stored_lookup(
    find: Callable[[str, bool], TensorRecord | None],
) -> Callable[[str, bool], StoredTensor | None]:
    """What restore planning needs to know of a stored tensor: dtype, shape, kind."""

    def lookup(key: str, rank_local: bool) -> StoredTensor | None:
        rec = find(key, rank_local)
        return StoredTensor(dtype_from_name(rec.dtype), tuple(rec.shape), rec.kind) if rec else None

    return lookup


def plan_tasks(
    reads: list[ReadRequest], find: Callable[[str, bool], TensorRecord | None]
) -> list[ReadTask]:
    """The reads of every requested key (restore planning only requests keys the manifest has)."""
    return [t for ts in tasks_per_read(reads, find) for t in ts]


def tasks_per_read(
    reads: list[ReadRequest], find: Callable[[str, bool], TensorRecord | None]
) -> list[list[ReadTask]]:
    """Each request's reads, in the requests' order."""
    out: list[list[ReadTask]] = []
    for req in reads:
        record = find(req.key, req.rank_local)
        assert record is not None
        out.append(read_tasks(req.key, record, req.target))
    return out


def _cold_whole_chunks(storage: Storage, tasks: list[ReadTask]) -> bool:
    """Whether to read in place with the rollback's copies made ahead: whole chunks into host
    memory from shards that are not in the page cache."""
    return all(reads_whole_chunk(t) for t in tasks) and not pages_cached(storage, tasks)


def pages_cached(storage: Storage, tasks: list[ReadTask]) -> bool:
    """Whether the shards' pages look cached: the last byte of the first, middle and last
    chunk of each file probed (a backend that cannot tell says yes, and keeps the mapped
    load). Last bytes, not first: reading the header, just before, brought the pages right
    after it in with the kernel's readahead, whatever the state of the rest."""
    probe = capabilities(storage).page_cache
    if probe is None:
        return True
    lasts: dict[str, list[int]] = {}
    for t in tasks:
        lasts.setdefault(t.chunk.file, []).append(max(t.chunk.start, t.chunk.end - 1))
    for file, offsets in lasts.items():
        offsets.sort()
        probes = sorted({offsets[0], offsets[len(offsets) // 2], offsets[-1]})
        if not probe.cached(file, probes):
            return False
    return True


def _rollback_ahead(
    reads: list[ReadRequest], per_read: list[list[ReadTask]]
) -> tuple[Rollback, list[Callable[[], None]]]:
    """A rollback that copies the targets aside in the order their bytes are read, while the
    reads run, and for each task the wait for its target's copy. By offset first: the shards
    are read side by side, each in file order, and each reader finds its next copy made."""
    order = sorted(
        (i for i in range(len(reads)) if per_read[i]),
        key=lambda i: min((t.chunk.start, t.chunk.file) for t in per_read[i]),
    )
    position = {req: at for at, req in enumerate(order)}
    rollback = Rollback([reads[i] for i in order], ahead=True)
    waits: list[Callable[[], None]] = [
        functools.partial(rollback.saved, position[i]) for i, ts in enumerate(per_read) for _ in ts
    ]
    return rollback, waits


def read_tasks(key: str, record: TensorRecord, target: torch.Tensor) -> list[ReadTask]:
    if len(record.chunks) == 1 and type(target) in (torch.Tensor, torch.nn.Parameter):
        # the common case, one whole chunk into a plain tensor: no box arithmetic, no slicing
        chunk = record.chunks[0]
        if list(target.shape) == chunk.sizes and not any(chunk.offsets):
            box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            return [ReadTask(key, record, chunk, box, target)]
    box = local_box(target)
    data = local_data(target)
    tasks = []
    for chunk in record.chunks:
        part = overlap(Box(tuple(chunk.offsets), tuple(chunk.sizes)), box)
        if (
            part is None
            and box.numel == 0
            and Box(tuple(chunk.offsets), tuple(chunk.sizes)).numel == 0
        ):
            continue
        if part is not None:
            tasks.append(ReadTask(key, record, chunk, part, data[local_slices(box, part)]))
    return tasks


def run_reads(
    storage: Storage,
    tasks: list[ReadTask],
    threads: int,
    waits: list[Callable[[], None]] | None = None,
) -> int:
    """Whole chunks go straight into their targets, shard by shard in file order; the rest
    (resharding overlaps) read their covering spans on a thread pool. A task's ``waits`` entry
    runs before anything is read into its target."""
    befores: list[Callable[[], None] | None] = list(waits) if waits else [None] * len(tasks)
    whole = [reads_whole_chunk(t) for t in tasks]
    direct = [_direct_read(t, b) for t, b, w in zip(tasks, befores, whole) if w]
    rest = [(t, b) for t, b, w in zip(tasks, befores, whole) if not w]
    counter = _Counter()
    counter.add(read_in_file_order(storage, direct, threads))

    def read_rest(item: tuple[ReadTask, Callable[[], None] | None]) -> int:
        if item[1] is not None:
            item[1]()
        return read_one(storage, item[0])

    if threads <= 1 or len(rest) <= 1:
        for item in rest:
            counter.add(read_rest(item))
        return counter.value
    with ThreadPoolExecutor(threads, thread_name_prefix="snapstate-read") as pool:
        for n in pool.map(read_rest, rest):
            counter.add(n)
    return counter.value


def _direct_read(task: ReadTask, before: Callable[[], None] | None = None) -> DirectRead:
    out = byte_view(task.target)
    return DirectRead(
        task.chunk.file,
        task.chunk.start,
        out,
        task.key,
        functools.partial(verify, out, 0, task.chunk, task.key),
        before,
    )


def read_one(storage: Storage, task: ReadTask) -> int:
    """Read and verify what ``task`` needs; returns the bytes read from storage."""
    chunk = task.chunk
    if chunk.compressed:
        return read_compressed(storage, task)
    dtype = dtype_from_name(task.record.dtype)
    chunk_box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
    itemsize = dtype_itemsize(dtype)
    nbytes = chunk_box.numel * itemsize
    if reads_whole_chunk(task):
        target_bytes = byte_view(task.target)
        read_bytes(storage, chunk, chunk.start, target_bytes, task.key)
        verify(target_bytes, 0, chunk, task.key)
        return nbytes
    span = covering_span(chunk_box, task.part, itemsize, chunk.block_bytes)
    buffer = empty_bytes(span.end - span.start)
    view = byte_view(buffer)
    read_bytes(storage, chunk, chunk.start + span.start, view, task.key)
    verify(view, span.first_block, chunk, task.key)
    bits_view(task.target).copy_(
        bits_view(select(buffer, span.start, span.row_start, chunk_box, task.part, dtype, itemsize))
    )
    return len(view)


class _Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n
