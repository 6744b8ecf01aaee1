"""Load with read-once-and-send: each shared byte range is read by one rank and sent to the others.

This is a foreground collective of ``load``: the ranks gather what spans they need, agree on
who reads what (``planning/readplan.py``), read and verify their share, agree that every read
succeeded (so that a corrupt file raises on every rank instead of hanging the transfers), and
then move the shared bytes: a broadcast when every rank needs them, point-to-point otherwise.
Receivers trust the reader's checksum verification; the transport has its own.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.engine.chunkread import (
    ReadTask,
    chunk_box,
    read_bytes,
    reads_whole_chunk,
    select,
    task_itemsize,
    verify,
)
from snapstate.engine.staging import bits_view, byte_view
from snapstate.format.dtypes import dtype_from_name, empty_bytes
from snapstate.planning.readplan import DEFAULT_BATCH_BYTES, Batch, ReadPlan, Span, plan_reads
from snapstate.planning.reshard import covering_span
from snapstate.storage.base import Storage


@dataclass
class Need:
    """One span this rank needs and the reads it serves."""

    span: Span
    first_block: int  # checksum block of the chunk the span starts at
    tasks: list[ReadTask] = field(default_factory=list)
    buffer: torch.Tensor | None = None  # uint8, the span's bytes once read or received

    @property
    def direct(self) -> bool:
        """The span is exactly one task's contiguous CPU target: read or receive straight into it."""
        return len(self.tasks) == 1 and reads_whole_chunk(self.tasks[0])


@dataclass
class SharedLoadStats:
    bytes_read: int = 0
    bytes_received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_read(self, n: int) -> None:
        with self.lock:
            self.bytes_read += n


def fail_together(coord: Coordinator, exc: BaseException) -> None:
    """Join the first gather of the others with an error, so they raise instead of waiting."""

    def fail() -> None:
        raise exc

    gather_or_raise(coord, fail)


def transport_ok(coord: Coordinator) -> bool:
    """Shared reads move bytes with CPU tensors; on other backends every rank reads for itself."""
    return getattr(coord, "backend", "gloo") == "gloo"


def shared_reads(
    coord: Coordinator,
    storage: Storage,
    tasks: list[ReadTask],
    threads: int,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> SharedLoadStats:
    needs = group_needs(tasks)
    gathered = gather_or_raise(coord, lambda: list(needs))
    plan = plan_reads(gathered, batch_bytes)
    stats = SharedLoadStats()
    mine = [needs[s] for s in plan.reads_for(coord.rank, list(needs))]

    def read_mine() -> None:  # an error here is raised on every rank by the gather
        _run_parallel(
            lambda n: _read_need(storage, n, stats, finish=n.span not in plan.readers),
            mine,
            threads,
        )

    gather_or_raise(coord, read_mine)
    _transfer(coord, plan, needs, stats)
    for need in needs.values():
        if need.span in plan.readers:
            _copy_out(need)
    return stats


def group_needs(tasks: list[ReadTask]) -> dict[Span, Need]:
    needs: dict[Span, Need] = {}
    for task in tasks:
        span, first_block = task_span(task)
        needs.setdefault(span, Need(span, first_block)).tasks.append(task)
    return needs


def task_span(task: ReadTask) -> tuple[Span, int]:
    """The bytes a task reads: the whole chunk, or the block-aligned span covering its part."""
    chunk = task.chunk
    box = chunk_box(task)
    if task.part == box:
        return Span(chunk.file, chunk.start, chunk.end), 0
    span = covering_span(box, task.part, task_itemsize(task), chunk.block_bytes)
    return Span(chunk.file, chunk.start + span.start, chunk.start + span.end), span.first_block


def _read_need(storage: Storage, need: Need, stats: SharedLoadStats, finish: bool) -> None:
    buffer = _buffer(need)
    task = need.tasks[0]
    view = byte_view(buffer)
    read_bytes(storage, task.chunk, need.span.start, view, task.key)
    verify(view, need.first_block, task.chunk, task.key)
    stats.add_read(need.span.nbytes)
    need.buffer = buffer
    if finish:
        _copy_out(need)


def _buffer(need: Need) -> torch.Tensor:
    if need.direct:
        return need.tasks[0].target.detach().reshape(-1).view(torch.uint8)
    return empty_bytes(need.span.nbytes)


def _copy_out(need: Need) -> None:
    """Copy the parts of a read or received span into targets that did not receive it directly."""
    if need.direct or need.buffer is None:
        return
    chunk_start = need.tasks[0].chunk.start
    for task in need.tasks:
        box = chunk_box(task)
        dtype = dtype_from_name(task.record.dtype)
        span_start = need.span.start - chunk_start
        row_start = task.part.offsets[0] - box.offsets[0] if box.sizes else 0
        selected = select(
            need.buffer, span_start, row_start, box, task.part, dtype, task_itemsize(task)
        )
        bits_view(task.target).copy_(bits_view(selected))
    need.buffer = None


def _transfer(
    coord: Coordinator, plan: ReadPlan, needs: dict[Span, Need], stats: SharedLoadStats
) -> None:
    import torch.distributed as dist

    group = getattr(coord, "group", None)
    everyone = coord.world_size - 1
    for tag, batch in enumerate(plan.batches):
        me = coord.rank
        if me != batch.reader and me not in batch.receivers:
            continue  # point-to-point between others (a broadcast involves every rank)
        buffer, pieces = _batch_buffer(batch, needs, sending=me == batch.reader)
        if len(batch.receivers) == everyone:
            dist.broadcast(buffer, src=_global(batch.reader, group), group=group)
        elif me == batch.reader:
            for w in [
                dist.isend(buffer, _global(r, group), group=group, tag=tag) for r in batch.receivers
            ]:
                if w is not None:
                    w.wait()
        else:
            dist.recv(buffer, _global(batch.reader, group), group=group, tag=tag)
        if me != batch.reader:
            stats.bytes_received += batch.nbytes
            _scatter(buffer, pieces, needs)


def _batch_buffer(
    batch: Batch, needs: dict[Span, Need], sending: bool
) -> tuple[torch.Tensor, list[Span]]:
    """One span read straight into its target travels as it is; several are concatenated."""
    if len(batch.spans) == 1:
        need = needs[batch.spans[0]]
        if need.buffer is None:
            need.buffer = _buffer(need)
        return need.buffer, []
    if sending:
        return torch.cat([needs[s].buffer for s in batch.spans]), []  # type: ignore[misc]
    return empty_bytes(batch.nbytes), list(batch.spans)


def _scatter(buffer: torch.Tensor, spans: list[Span], needs: dict[Span, Need]) -> None:
    offset = 0
    for s in spans:
        need = needs[s]
        if need.direct:
            _buffer(need).copy_(buffer[offset : offset + s.nbytes])
        else:
            need.buffer = buffer[offset : offset + s.nbytes]
        offset += s.nbytes


def _global(rank: int, group: Any) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _run_parallel(fn: Any, items: list[Any], threads: int) -> None:
    if threads <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="snapstate-read") as pool:
        list(pool.map(fn, items))
