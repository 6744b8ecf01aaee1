"""What to read on load: N-D overlap of a target box with stored chunks, block-aligned ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass

from snapstate.planning.items import Box


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when they do not meet (or one is empty)."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class ByteSpan:
    """A block-aligned byte range of a stored chunk that covers an overlap."""

    start: int  # relative to the chunk start
    end: int
    first_block: int
    row_start: int  # first dim-0 row of the chunk inside the span


def covering_span(chunk: Box, part: Box, itemsize: int, block_bytes: int) -> ByteSpan:
    """The bytes of ``chunk`` (row-major) to read for ``part``, widened to whole checksum blocks."""
    nbytes = chunk.numel * itemsize
    if not chunk.sizes:
        return ByteSpan(0, nbytes, 0, 0)
    row_bytes = math.prod(chunk.sizes[1:]) * itemsize
    first_row = part.offsets[0] - chunk.offsets[0]
    lo = first_row * row_bytes
    hi = (first_row + part.sizes[0]) * row_bytes
    block = lo // block_bytes
    start = block * block_bytes
    end = min(nbytes, -(-hi // block_bytes) * block_bytes)
    return ByteSpan(start, end, block, first_row)


def local_slices(container: Box, part: Box) -> tuple[slice, ...]:
    """Slices selecting ``part`` out of a tensor that holds ``container``."""
    return tuple(
        slice(p - c, p - c + s) for p, c, s in zip(part.offsets, container.offsets, part.sizes)
    )
