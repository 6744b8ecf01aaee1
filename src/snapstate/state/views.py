"""Views of tensor memory (bytes, same-size integers, row pieces, staged bytes): no copies, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_size_int(itemsize: int) -> torch.dtype | None:
    """The integer dtype of this itemsize, if torch has one."""
    return _SAME_SIZE_INTS.get(itemsize)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer dtype of the same itemsize: copies stay bitwise and work
    for dtypes without copy kernels (int1..uint7 cannot be copied when non-contiguous)."""
    int_dtype = same_size_int(t.element_size())
    return t.view(int_dtype) if int_dtype is not None and t.dtype != int_dtype else t


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def row_pieces(view: torch.Tensor, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Split a chunk along dim 0 into (byte offset in chunk, rows) of at most ``max_bytes``.

    A single row larger than ``max_bytes`` is split along its own first dimension, so that a
    wide tensor (``(1, N)``) still streams through a small staging budget. Each piece covers
    consecutive bytes of the chunk's row-major layout.
    """
    if view.dim() == 0 or view.shape[0] == 0 or view.numel() * view.element_size() <= max_bytes:
        yield 0, view
        return
    row_bytes = (view.numel() // view.shape[0]) * view.element_size()
    if row_bytes > max_bytes and view.dim() > 1:
        for row in range(view.shape[0]):
            for offset, piece in row_pieces(view[row], max_bytes):
                yield row * row_bytes + offset, piece
        return
    rows = max(1, max_bytes // max(row_bytes, 1))
    for start in range(0, view.shape[0], rows):
        yield start * row_bytes, view[start : start + rows]


@dataclass
class StagedBytes:
    """Bytes ready to write or hash, and how to hand their buffer back."""

    data: memoryview
    release: Callable[[], None] | None  # give the buffer back once written
    ready: Callable[[], None] | None  # wait for an asynchronous device copy

    def part(self, index: int, begin: int, end: int) -> memoryview:
        """The bytes of a job's part ``index``: ``[begin, end)`` of the data."""
        return self.data[begin:end]


@dataclass
class GatheredBytes:
    """Bytes written from where they lie (a blocking save's runs): no staging copy at all.

    ``buffers`` are the range's bytes in order, the gaps between chunks as zeros;
    ``chunks`` holds each part's own bytes, for hashing.
    """

    buffers: tuple[memoryview, ...]
    chunks: tuple[memoryview, ...]
    release: None = None
    ready: None = None

    def part(self, index: int, begin: int, end: int) -> memoryview:
        return self.chunks[index]


def gathered(views: list[memoryview], offsets: tuple[int, ...], nbytes: int) -> GatheredBytes:
    """``views[i]`` at ``offsets[i]`` of a range of ``nbytes``, zeros between them."""
    buffers = with_gaps(views, offsets, nbytes, lambda n: memoryview(bytes(n)))
    return GatheredBytes(tuple(buffers), tuple(views))


def with_gaps(
    views: list[memoryview],
    offsets: Sequence[int],
    nbytes: int,
    gap: Callable[[int], memoryview],
) -> list[memoryview]:
    """The buffers of one vectored write or read of a range of ``nbytes``: ``views[i]`` at
    ``offsets[i]`` (sorted), ``gap(n)`` for each hole between them. Empty views are left out
    (an empty tensor's view is read-only, and a vectored read needs writable buffers)."""
    buffers: list[memoryview] = []
    at = 0
    for view, offset in zip(views, offsets):
        if offset > at:
            buffers.append(gap(offset - at))
        if len(view):
            buffers.append(view)
        at = max(at, offset + len(view))
    if nbytes > at:
        buffers.append(gap(nbytes - at))
    return buffers
