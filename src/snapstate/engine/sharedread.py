"""Read-once-and-send, the reading side: each shared byte range is read by one rank, verified,
and copied into the targets of every rank that needs it.

The ranks gather what spans they need, agree on who reads what (``planning/readplan.py``),
read and verify their share, agree that every read succeeded (so that a corrupt file raises on
every rank instead of hanging the transfers), and then move the shared bytes
(``collective/loadshare.py``: a broadcast when every rank needs them, point-to-point
otherwise). Receivers trust the reader's checksum verification; the transport has its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.collective.loadshare import send_batches
from snapstate.engine.chunkread import (
    ReadTask,
    chunk_box,
    read_bytes,
    reads_whole_chunk,
    select,
    task_itemsize,
    verify,
)
from snapstate.format.dtypes import dtype_from_name, empty_bytes
from snapstate.planning.readplan import DEFAULT_BATCH_BYTES, Batch, Span, plan_reads
from snapstate.planning.reshard import covering_span
from snapstate.state.views import bits_view, byte_view
from snapstate.storage.base import Storage

T = TypeVar("T")


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


def shared_reads(
    coord: Coordinator,
    storage: Storage,
    tasks: list[ReadTask],
    threads: int,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    timeout: float | None = None,
) -> SharedLoadStats:
    """Read this rank's share of the bytes the ranks need, agree every read passed, then send
    and receive the rest; every wait for another rank bounded by ``timeout``."""
    needs = group_needs(tasks)
    gathered = gather_or_raise(coord, lambda: list(needs), timeout)
    plan = plan_reads(gathered, batch_bytes)
    stats = SharedLoadStats()
    mine = [needs[s] for s in plan.reads_for(coord.rank, list(needs))]

    def read_mine() -> None:  # an error here is raised on every rank by the gather
        _run_parallel(
            lambda n: _read_need(storage, n, stats, finish=n.span not in plan.readers),
            mine,
            threads,
        )

    gather_or_raise(coord, read_mine, timeout)
    stats.bytes_received += send_batches(
        coord,
        plan,
        lambda batch, sending: _batch_buffer(batch, needs, sending),
        lambda batch, buffer: _scatter(buffer, batch, needs),
        timeout,
    )
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


def _batch_buffer(batch: Batch, needs: dict[Span, Need], sending: bool) -> torch.Tensor:
    """One span read straight into its target travels as it is; several are concatenated."""
    if len(batch.spans) == 1:
        need = needs[batch.spans[0]]
        if need.buffer is None:
            need.buffer = _buffer(need)
        return need.buffer
    if sending:
        return torch.cat([_read_buffer(needs[s]) for s in batch.spans])
    return empty_bytes(batch.nbytes)


def _read_buffer(need: Need) -> torch.Tensor:
    assert need.buffer is not None, "the reader sends only spans it has read"
    return need.buffer


def _scatter(buffer: torch.Tensor, batch: Batch, needs: dict[Span, Need]) -> None:
    """A received batch of several spans is split back into them (one came in place)."""
    if len(batch.spans) == 1:
        return
    offset = 0
    for s in batch.spans:
        need = needs[s]
        if need.direct:
            _buffer(need).copy_(buffer[offset : offset + s.nbytes])
        else:
            need.buffer = buffer[offset : offset + s.nbytes]
        offset += s.nbytes


def _run_parallel(fn: Callable[[T], None], items: list[T], threads: int) -> None:
    if threads <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="snapstate-read") as pool:
        list(pool.map(fn, items))
