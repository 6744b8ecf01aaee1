"""Staging: copy this rank's chunks into a reusable host buffer pool under a memory budget.

This is the only part of an async save that stalls training. Buffers are kept warm between
saves (copying into existing memory beats allocating it); when the state is larger than the
budget, staging waits for the writer to free slabs, so the stall grows and the memory does not.
On CUDA the slabs are pinned and copies run on a side stream that the training stream waits on.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from snapstate.engine.stageplan import BATCH_DTYPES, RunLayout
from snapstate.errors import CheckpointTimeoutError
from snapstate.format.dtypes import empty_bytes
from snapstate.state.views import (
    GatheredBytes,
    StagedBytes,
    bits_view,
    byte_view,
    gathered,
)
from snapstate.storage.buffers import DIRECT_ALIGN

DEFAULT_SLAB_BYTES = 64 << 20
ALIGN = 64
# Bytes bound for a file offset start at an address that agrees with it modulo a page, so
# that the writer can send them past the page cache (storage/local.py: O_DIRECT).
PAGE_ALIGN = DIRECT_ALIGN
MAX_SLAB_VIEWS = 1 << 16
# Chunks up to this size are staged in runs by a blocking save (it copies runs and writes
# larger chunks from the caller's memory); an async save copies everything, so its runs take
# any chunk that fits a slab.
SMALL_CHUNK_BYTES = 1 << 20
# A run copies on several threads from this size on (one thread copies about 6 GB/s here).
PARALLEL_RUN_BYTES = 4 << 20


def host_memory_bytes() -> int | None:
    """The machine's memory, or None when the system does not say.

    From sysconf, not psutil: importing psutil on the first save cost its stall 12-15 ms.
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # the callers have their own fallbacks
        return None


def default_budget() -> int:
    total = host_memory_bytes()
    if total is None:
        return 8 << 30  # a fixed fallback
    return max(DEFAULT_SLAB_BYTES, int(total * 0.25))


class Slab:
    """One host buffer; pieces are bump-allocated into it and released by the writer."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        # Page-aligned, with a page to spare: a piece of the full size can still be placed
        # at the address its file offset asks for (``HostBufferPool.reserve``).
        if pinned:
            raw = torch.empty(nbytes + 2 * PAGE_ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % PAGE_ALIGN
            self.buffer = raw[skip : skip + nbytes + PAGE_ALIGN]
        else:  # not torch.empty: see empty_bytes
            self.buffer = empty_bytes(nbytes + PAGE_ALIGN, align=PAGE_ALIGN)
        self.nbytes = nbytes  # the budget's count; the room is a page more
        self.room = nbytes + PAGE_ALIGN
        self.used = 0
        self.in_flight = 0
        self.sealed = False
        self.bytes = byte_view(self.buffer)
        # Typed views into the buffer per run, kept across saves: an unchanged plan stages the
        # same runs at the same offsets, and making a view costs more than copying a small
        # tensor. Keyed by the layout's id; the layout is held so that its id stays its own.
        self._views: dict[tuple[int, int], tuple[RunLayout, list[torch.Tensor]]] = {}
        self._view_count = 0

    def run_views(self, start: int, layout: RunLayout) -> list[torch.Tensor]:
        """Views of the run's tensors in this slab, the run starting at byte ``start``."""
        known = self._views.get((start, id(layout)))
        if known is not None and known[0] is layout:
            return known[1]
        if self._view_count >= MAX_SLAB_VIEWS:
            self._views.clear()
            self._view_count = 0
        views = layout_views(self.buffer, start, layout)
        self._views[(start, id(layout))] = (layout, views)
        self._view_count += len(views)
        return views

    def reset(self) -> None:
        self.used = self.in_flight = 0
        self.sealed = False


class HostBufferPool:
    """Slabs of ``slab_bytes`` allocated lazily up to ``budget_bytes`` and reused across saves."""

    def __init__(
        self,
        budget_bytes: int | None = None,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        pin: bool | None = None,
    ) -> None:
        self.budget_bytes = max(budget_bytes or default_budget(), slab_bytes)
        self.slab_bytes = slab_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._cond = threading.Condition()
        self._free: list[Slab] = []
        self._allocated = 0
        self._current: Slab | None = None
        self.peak_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def reserve(
        self,
        nbytes: int,
        timeout: float | None,
        before_wait: Callable[[], None] | None = None,
        file_offset: int | None = None,
    ) -> tuple[Slab, int]:
        """A slab and offset with room for ``nbytes``; waits while the budget is spent.

        ``before_wait`` runs first when the call would wait: it hands held pieces to the
        writer, the only one that can free a slab (it must not take the pool's lock).
        With ``file_offset`` (where the bytes go in their file) the offset agrees with it
        modulo a page.
        """
        with self._cond:
            slab = self._current
            if slab is not None and _placed(slab.used, file_offset) + nbytes <= slab.room:
                return self._take(slab, nbytes, file_offset)
            self._seal_current()
            slab = self._new_slab(max(nbytes, self.slab_bytes), timeout, before_wait)
            self._current = slab
            return self._take(slab, nbytes, file_offset)

    def release(self, slab: Slab) -> None:
        with self._cond:
            slab.in_flight -= 1
            self._recycle_if_idle(slab)

    def seal(self) -> None:
        """End of a save's staging: the current slab takes no more pieces."""
        with self._cond:
            self._seal_current()

    def clear(self) -> None:
        """Drop idle slabs (memory returns to the allocator)."""
        with self._cond:
            self._allocated -= sum(s.nbytes for s in self._free)
            self._free.clear()

    def _take(self, slab: Slab, nbytes: int, file_offset: int | None) -> tuple[Slab, int]:
        offset = _placed(slab.used, file_offset)
        slab.used = -(-(offset + nbytes) // ALIGN) * ALIGN
        slab.in_flight += 1
        return slab, offset

    def _seal_current(self) -> None:
        if self._current is not None:
            self._current.sealed = True
            self._recycle_if_idle(self._current)
            self._current = None

    def _recycle_if_idle(self, slab: Slab) -> None:
        if slab.sealed and slab.in_flight == 0:
            if slab.nbytes == self.slab_bytes:
                slab.reset()
                self._free.append(slab)
            else:  # an oversized one-off slab is not kept warm
                self._allocated -= slab.nbytes
            self._cond.notify_all()

    def _new_slab(
        self, nbytes: int, timeout: float | None, before_wait: Callable[[], None] | None = None
    ) -> Slab:
        def available() -> bool:
            return (
                (nbytes == self.slab_bytes and bool(self._free))
                or self._allocated + nbytes <= self.budget_bytes
                or self._allocated == 0
            )

        if before_wait is not None and not available():
            before_wait()
        if not self._cond.wait_for(available, timeout=timeout):
            raise CheckpointTimeoutError(
                f"no staging buffer freed within {timeout}s (budget {self.budget_bytes} bytes)"
            )
        if nbytes == self.slab_bytes and self._free:
            return self._free.pop()
        self._allocated += nbytes
        self.peak_bytes = max(self.peak_bytes, self._allocated)
        return Slab(nbytes, self.pin)


def _placed(used: int, file_offset: int | None) -> int:
    """The first offset from ``used`` that agrees with ``file_offset`` modulo a page."""
    return used if file_offset is None else used + (file_offset - used) % PAGE_ALIGN


COPY_SEGMENT_BYTES = 8 << 20
_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()


def copy_threads() -> int:
    """This process's share of the cores (ranks on one host share them: torchrun's
    LOCAL_WORLD_SIZE), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, cores // local))


def _copier_pool() -> ThreadPoolExecutor:
    global _copiers
    with _copiers_lock:
        if _copiers is None:
            _copiers = ThreadPoolExecutor(copy_threads(), thread_name_prefix="snapstate-copy")
        return _copiers


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy contiguous CPU ``src`` into ``dst`` (same size) in segments, on a few threads.

    Why not ``dst.copy_(src)``: torch's intra-op threads meet at a barrier, so on a busy
    machine one preempted thread holds up the whole copy. Independent segments (numpy's
    memcpy, which releases the GIL) measured about half the time on the loaded 2-core CI box.
    """
    d = dst.detach().reshape(-1).view(torch.uint8).numpy()
    s = src.detach().reshape(-1).view(torch.uint8).numpy()
    if len(d) <= COPY_SEGMENT_BYTES or copy_threads() == 1:
        np.copyto(d, s)
        return
    segments = range(0, len(d), COPY_SEGMENT_BYTES)
    list(
        _copier_pool().map(
            lambda i: np.copyto(d[i : i + COPY_SEGMENT_BYTES], s[i : i + COPY_SEGMENT_BYTES]),
            segments,
        )
    )


def layout_views(buffer: torch.Tensor, start: int, layout: RunLayout) -> list[torch.Tensor]:
    return [
        buffer[start + o : start + o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for o, dtype, shape in zip(layout.offsets, layout.dtypes, layout.shapes)
    ]


def copy_run(dsts: list[torch.Tensor], srcs: list[torch.Tensor], layout: RunLayout) -> None:
    """Batched copies of a run: one per thread, each over a span of about equal bytes.

    Why not torch's intra-op threads: they meet at a barrier after each tensor, so on a busy
    machine one preempted thread holds up every copy of the run (measured 10-50x slower on
    the loaded 2-core CI box). Independent batched copies of their own spans do not wait
    for each other, and torch releases the GIL while each runs.
    """
    parts = min(copy_threads(), layout.nbytes // PARALLEL_RUN_BYTES)
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        if parts < 2 or len(dsts) < 2:
            torch._foreach_copy_(dsts, srcs)
            return
        cuts = layout.split(parts)
        spans = list(zip(cuts, cuts[1:]))
        futures = [
            _copier_pool().submit(torch._foreach_copy_, dsts[a:b], srcs[a:b]) for a, b in spans[1:]
        ]
        try:
            a, b = spans[0]
            torch._foreach_copy_(dsts[a:b], srcs[a:b])
        finally:
            for f in futures:  # every copy has ended before the run is handed on
                f.result()
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


class Stager:
    """Copies pieces into the pool (async saves) or exposes them in place (blocking saves)."""

    def __init__(
        self,
        pool: HostBufferPool | None,
        timeout: float | None,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        self.timeout = timeout
        self.before_wait = before_wait  # see HostBufferPool.reserve
        self.stream = (
            torch.cuda.Stream() if (pool is not None and torch.cuda.is_available()) else None
        )
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())

    def stage(self, piece: torch.Tensor, file_offset: int | None = None) -> StagedBytes:
        """One piece: in place for a blocking save, else copied into the pool (at an address
        that agrees with ``file_offset``, where the piece goes in its file, modulo a page)."""
        if self.pool is None and piece.device.type == "cpu" and piece.is_contiguous():
            return StagedBytes(byte_view(piece), None, None)  # zero-copy: the caller blocks anyway
        return self._copy(piece, file_offset)

    def batchable(self, view: torch.Tensor) -> bool:
        """Whether this chunk may be staged in a run (one batched copy for many chunks)."""
        return (
            view.dtype in BATCH_DTYPES
            and view.is_contiguous()
            and (view.device.type == "cpu" or self.stream is not None)
        )

    def runnable(self, views: list[torch.Tensor]) -> bool:
        """Whether these tensors can be copied by one batched copy (same device, plain memory)."""
        if all(v.is_cpu and v.is_contiguous() for v in views):
            return True
        device = views[0].device
        return self.stream is not None and all(
            v.device == device and v.is_contiguous() for v in views
        )

    def stage_run(
        self, views: list[torch.Tensor], layout: RunLayout, file_offset: int | None = None
    ) -> StagedBytes | GatheredBytes:
        """Copy whole chunks into one range laid out by ``layout`` (see ``copy_run``), or in
        a blocking save, hand them over where they lie (the caller waits for the writes).

        The layout's offsets are the chunks' places in their file, relative to the first one,
        which the planner aligns to each chunk's itemsize.
        """
        nbytes = layout.nbytes
        if self.pool is None:  # blocking save: written from the caller's memory, in one go
            return gathered([byte_view(v) for v in views], layout.offsets, nbytes)
        slab, start = self.pool.reserve(nbytes, self.timeout, self.before_wait, file_offset)
        pool = self.pool
        try:
            dsts = slab.run_views(start, layout)
            if self.stream is not None and views[0].device.type == "cuda":
                return self._copy_run_cuda(slab, start, nbytes, dsts, views)
            copy_run(dsts, views, layout)
        except BaseException:
            pool.release(slab)  # nobody will write this run: its room must not stay taken
            raise
        return StagedBytes(slab.bytes[start : start + nbytes], lambda: pool.release(slab), None)

    def _copy_run_cuda(
        self,
        slab: Slab,
        start: int,
        nbytes: int,
        dsts: list[torch.Tensor],
        views: list[torch.Tensor],
    ) -> StagedBytes:
        assert self.stream is not None and self.pool is not None
        pool = self.pool
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(dsts, views, non_blocking=True)
            for v in views:
                if v.is_cuda:
                    v.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        data = slab.bytes[start : start + nbytes]
        return StagedBytes(data, lambda: pool.release(slab), event.synchronize)

    def finish(self) -> None:
        if self.pool is not None:
            self.pool.seal()
        if self.stream is not None:
            # later updates wait for our copies
            torch.cuda.current_stream().wait_stream(self.stream)

    def _copy(self, piece: torch.Tensor, file_offset: int | None) -> StagedBytes:
        nbytes = piece.numel() * piece.element_size()
        if self.pool is None:  # blocking save of a non-contiguous or device tensor
            host = bits_view(piece.detach()).to("cpu").contiguous()
            return StagedBytes(byte_view(host), None, None)
        slab, offset = self.pool.reserve(nbytes, self.timeout, self.before_wait, file_offset)
        dst = slab.buffer[offset : offset + nbytes].view(piece.dtype).view(piece.shape)
        pool = self.pool
        if self.stream is not None and piece.device.type == "cuda":
            with torch.cuda.stream(self.stream):
                bits_view(dst).copy_(bits_view(piece.detach()), non_blocking=True)
                piece.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
            return StagedBytes(byte_view(dst), lambda: pool.release(slab), event.synchronize)
        try:
            if piece.device.type == "cpu" and piece.is_contiguous() and nbytes:
                copy_bytes(dst, piece)
            else:
                with torch.no_grad():
                    bits_view(dst).copy_(bits_view(piece.detach()))
        except BaseException:
            pool.release(slab)  # nobody will write this piece: its room must not stay taken
            raise
        return StagedBytes(byte_view(dst), lambda: pool.release(slab), None)
