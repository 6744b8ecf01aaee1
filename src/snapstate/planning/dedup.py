"""Who writes what: replicated data once in total, balanced by bytes across ranks."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from snapstate.planning.holdings import Holdings
from snapstate.planning.items import Box, ItemMeta

DEFAULT_CHUNK_BYTES = 32 << 20

# One chunk before it has a writer: its metadata, its box, its bytes. Plain tuples, since a
# job of 4,096 ranks has about half a million of them; WriteItems are made only for the
# rank that asks (SavePlan.items_of).
Chunk = tuple[ItemMeta, Box, int]


@dataclass(frozen=True)
class Flexible:
    """A chunk that several ranks hold, any of which may write it."""

    chunk: Chunk
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Assignment:
    """Each rank's chunks (what it writes) and, for the chunks several ranks could have
    written, who got each: the replica check's witnesses are found from it."""

    chunks: tuple[tuple[Chunk, ...], ...]
    flexible: tuple[tuple[Flexible, int], ...]  # (chunk, its writer), largest first


def split_box(box: Box, itemsize: int, chunk_bytes: int, numel: int | None = None) -> list[Box]:
    """Split along dim 0 into pieces of about ``chunk_bytes``; each piece is contiguous on disk."""
    numel = box.numel if numel is None else numel
    if not box.sizes or box.sizes[0] <= 1 or numel * itemsize <= chunk_bytes:
        return [box]
    row_bytes = max(1, (numel // box.sizes[0]) * itemsize)
    rows = max(1, chunk_bytes // row_bytes)
    pieces = []
    for start in range(0, box.sizes[0], rows):
        n = min(rows, box.sizes[0] - start)
        pieces.append(Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.sizes[1:])))
    return pieces


def assign(holdings: Holdings, chunk_bytes: int) -> Assignment:
    """Every unique chunk of the job to one writer (pure, the same on every rank).

    A chunk one rank holds is written by it; one that several hold goes, largest first, to
    the least-loaded holder: the busiest rank's share is at most total/N + one chunk.
    """
    world = holdings.world_size
    chunks: list[list[Chunk]] = [[] for _ in range(world)]
    loads = [0] * world
    for rank, meta in holdings.local:
        for box in meta.boxes:
            for piece in split_box(box, meta.itemsize, chunk_bytes):
                _give(chunks, loads, rank, (meta, piece, piece.numel * meta.itemsize))
    flexible: list[Flexible] = []
    for holding in holdings.shared:
        meta, box, ranks = holding.meta, holding.box, holding.ranks
        numel = box.numel
        if not numel and math.prod(meta.shape) > 0:
            continue  # an empty shard (more ranks than rows): nothing to write
        writers = (0,) if meta.from_rank0 and 0 in ranks else ranks
        pieces = split_box(box, meta.itemsize, chunk_bytes, numel)
        for piece in pieces:
            nbytes = (numel if len(pieces) == 1 else piece.numel) * meta.itemsize
            if len(writers) == 1:
                _give(chunks, loads, writers[0], (meta, piece, nbytes))
            else:
                flexible.append(Flexible((meta, piece, nbytes), tuple(sorted(writers))))
    flexible.sort(key=lambda f: (-f.chunk[2], f.chunk[0].key, f.chunk[1].offsets))
    given = _assign_flexible(flexible, chunks, loads)
    return Assignment(tuple(tuple(c) for c in chunks), given)


def _assign_flexible(
    flexible: list[Flexible], chunks: list[list[Chunk]], loads: list[int]
) -> tuple[tuple[Flexible, int], ...]:
    world = len(loads)
    if world > 1 and all(len(f.ranks) == world for f in flexible):
        # All chunks can go anywhere (plain DDP): a heap makes this O(n log N) at 4096 ranks.
        heap = [(load, rank) for rank, load in enumerate(loads)]
        heapq.heapify(heap)
        given = []
        for f in flexible:
            _, rank = heapq.heappop(heap)
            _give(chunks, loads, rank, f.chunk)
            heapq.heappush(heap, (loads[rank], rank))
            given.append((f, rank))
        return tuple(given)
    out = []
    for f in flexible:
        rank = min(f.ranks, key=lambda r: (loads[r], r))
        _give(chunks, loads, rank, f.chunk)
        out.append((f, rank))
    return tuple(out)


def _give(chunks: list[list[Chunk]], loads: list[int], rank: int, chunk: Chunk) -> None:
    chunks[rank].append(chunk)
    loads[rank] += chunk[2]
