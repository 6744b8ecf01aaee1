"""Loads from mapped local shards: verify every byte first, then copy; nothing to roll back.

Reading chunks straight into the targets means a corrupt chunk is found after earlier ones
were overwritten, so that transport keeps a copy of every target to put back (as much memory
again as the state, and a copy of it). A shard on a local or parallel file system is read
twice instead: every needed block is read into scratch memory and its checksum checked, and
only when all pass are the bytes copied into the targets from the mapped shard, whose pages
the first read left in the page cache. Two passes over the page cache cost less than the
copy kept aside, and a failed load has touched no target.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from snapstate.engine.chunkread import (
    ReadTask,
    chunk_box,
    reads_whole_chunk,
    select,
    task_itemsize,
    verify,
)
from snapstate.engine.headers import shard_gone
from snapstate.engine.readorder import open_reader, read_from
from snapstate.engine.staging import copy_threads, host_memory_bytes
from snapstate.errors import CorruptCheckpointError
from snapstate.format.dtypes import dtype_from_name
from snapstate.planning.reshard import covering_span
from snapstate.state.views import bits_view
from snapstate.storage.base import FileReader, MappableFiles, Storage, capabilities
from snapstate.storage.buffers import buffer_address

# A state larger than this fraction of the machine's memory is read the other way: two
# passes over the page cache are only cheap while the shards stay in it.
MAX_MEMORY_FRACTION = 0.25
SPLIT_BYTES = 8 << 20
PARALLEL_BYTES = 256 << 20


def can_map(storage: Storage, nbytes: int) -> bool:
    """Whether this backend maps its files (``capabilities``: the class's own ``map_file``)
    and the bytes to load fit the page cache comfortably."""
    memory = host_memory_bytes() or 4 << 30  # unknown: be conservative
    mappable = capabilities(storage).mappable is not None
    return mappable and nbytes <= memory * MAX_MEMORY_FRACTION


@dataclass(frozen=True)
class _Mapped:
    """One task's stored bytes in a mapping: the whole chunk, or the span that covers it."""

    task: ReadTask
    data: memoryview
    offset: int  # of ``data`` in its file
    first_block: int
    whole: bool  # the whole chunk into contiguous host memory: a plain byte copy
    span_start: int = 0
    row_start: int = 0
    address: int = 0  # of ``data``'s first byte, for whole chunks


def load_mapped(
    storage: Storage,
    tasks: list[ReadTask],
    threads: int,
    agree: Callable[[Callable[[], None]], None] | None = None,
) -> int:
    """Verify what every task needs, then copy it into its target; returns the bytes read.

    ``agree(check)`` runs the checks as a collective (with several ranks: every rank's checks
    pass, or it raises on every rank), so that no rank writes a target unless all can.
    """
    files = {t.chunk.file for t in tasks}
    mappable = capabilities(storage).mappable
    if mappable is None:
        raise TypeError(f"{storage!r} does not map its files (see can_map)")
    with _mappings(mappable, files) as maps, _readers(storage, files) as readers:
        # where each mapping's bytes start (valid while it is open)
        bases = {file: buffer_address(view) for file, view in maps.items()}
        parts = [_locate(t, maps[t.chunk.file], bases[t.chunk.file]) for t in tasks]
        verifies, copies = _jobs(parts, readers)
        total = sum(len(p.data) for p in parts)
        # More threads only pay on large states: on 2 cores they measured slower below
        # hundreds of MB (they contend for the GIL between short jobs).
        threads = min(threads, copy_threads()) if total >= PARALLEL_BYTES else 1
        check = functools.partial(_in_parallel, verifies, threads)
        if agree is None:
            check()
        else:
            agree(check)
        with torch.no_grad():
            _in_parallel(copies, threads)
        del parts, verifies, copies, check  # the views go before the mappings close
    return total


def _jobs(
    parts: list[_Mapped], readers: dict[str, FileReader]
) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
    """One verify and one copy per part; whole chunks larger than SPLIT_BYTES in block-aligned
    ranges, so that one large tensor still spreads over the threads."""
    verifies: list[Callable[[], None]] = []
    copies: list[Callable[[], None]] = []
    for p in parts:
        block = p.task.chunk.block_bytes
        if p.whole and len(p.data) > SPLIT_BYTES:
            step = max(block, SPLIT_BYTES // block * block)
            for at in range(0, len(p.data), step):
                verifies.append(functools.partial(_verify, readers, p, at, at + step))
                copies.append(functools.partial(_copy_whole, p, at, at + step))
        else:
            verifies.append(functools.partial(_verify, readers, p, 0, len(p.data)))
            copies.append(functools.partial(_copy, p))
    return verifies, copies


@contextmanager
def _readers(storage: Storage, files: set[str]) -> Iterator[dict[str, FileReader]]:
    readers: dict[str, FileReader] = {}
    try:
        for file in sorted(files):
            try:
                readers[file] = open_reader(storage, file)
            except FileNotFoundError:  # mapped a moment ago: removed since (an overwrite)
                raise shard_gone(file, None) from None
        yield readers
    finally:
        for reader in readers.values():
            reader.close()


@contextmanager
def _mappings(storage: MappableFiles, files: set[str]) -> Iterator[dict[str, memoryview]]:
    maps: dict[str, mmap.mmap] = {}
    views: dict[str, memoryview] = {}
    try:
        for file in sorted(files):
            try:
                maps[file] = storage.map_file(file)
            except FileNotFoundError:
                raise shard_gone(file, None) from None
            except EOFError as exc:
                raise CorruptCheckpointError(f"shard file is truncated: {exc}", file=file) from None
            views[file] = memoryview(maps[file])
        yield views
    finally:
        # On an error a traceback's frames may still hold views: then the mapping is
        # unmapped when the last of them goes, not here.
        for view in views.values():
            with contextlib.suppress(BufferError):
                view.release()
        for m in maps.values():
            with contextlib.suppress(BufferError):
                m.close()


def _locate(task: ReadTask, mapped: memoryview, base: int) -> _Mapped:
    chunk = task.chunk
    if len(mapped) < chunk.end:
        raise CorruptCheckpointError(
            f"shard file is truncated: it ends at byte {len(mapped)}, the chunk at {chunk.end}",
            file=chunk.file,
            key=task.key,
        )
    if reads_whole_chunk(task):
        data = mapped[chunk.start : chunk.end]
        return _Mapped(task, data, chunk.start, 0, True, address=base + chunk.start)
    span = covering_span(chunk_box(task), task.part, task_itemsize(task), chunk.block_bytes)
    at = chunk.start + span.start
    data = mapped[at : chunk.start + span.end]
    return _Mapped(task, data, at, span.first_block, False, span.start, span.row_start)


_scratch = threading.local()


def _verify(readers: dict[str, FileReader], part: _Mapped, begin: int, end: int) -> None:
    """Blocks ``[begin, end)`` of the part's bytes (``begin`` on a block boundary).

    Hashed from a read into scratch memory, not from the mapping: with a cold page cache,
    reads stream at the disk's speed and faults on a mapping do not (measured 5x slower on
    512 MiB); the read leaves the pages cached for the copy that follows.
    """
    n = min(end, len(part.data)) - begin  # the last range of a split chunk is shorter
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < n:
        buffer = bytearray(max(n, SPLIT_BYTES))
        _scratch.buffer = buffer
    view = memoryview(buffer)[:n]
    chunk = part.task.chunk
    read_from(readers[chunk.file], chunk.file, part.offset + begin, view, part.task.key)
    verify(view, part.first_block + begin // chunk.block_bytes, chunk, part.task.key)


def _copy_whole(part: _Mapped, begin: int, end: int) -> None:
    # One memmove per range: hundreds of small tensors made numpy's per-call set-up a third
    # of the copy (34 MB, 308 tensors: 4.0-4.5 ms -> 2.6 ms); ctypes calls release the GIL,
    # so the ranges of a large state still copy side by side.
    n = min(end, len(part.data)) - begin
    target = part.task.target
    if n <= 0:
        return
    if begin + n > target.numel() * target.element_size():  # whole: contiguous, same size
        raise RuntimeError(f"copy of {n} bytes at {begin} overruns the target {part.task.key!r}")
    ctypes.memmove(target.data_ptr() + begin, part.address + begin, n)


def _copy(part: _Mapped) -> None:
    task = part.task
    if not len(part.data):
        return
    if part.whole:
        _copy_whole(part, 0, len(part.data))
        return
    dtype = dtype_from_name(task.record.dtype)
    stored = torch.frombuffer(part.data, dtype=torch.uint8)
    piece = select(
        stored,
        part.span_start,
        part.row_start,
        chunk_box(task),
        task.part,
        dtype,
        task_itemsize(task),
    )
    bits_view(task.target).copy_(bits_view(piece))


def _in_parallel(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run ``jobs`` on up to ``threads`` threads, dealt round-robin; the first error wins."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    batches = [jobs[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(threads, thread_name_prefix="snapstate-mapped") as pool:
        futures = [pool.submit(_run_all, b) for b in batches if b]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _run_all(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()
