"""Who writes what: replicated data once in total, balanced by bytes across ranks."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from snapstate.planning.items import Box, ItemMeta, Placement, WriteItem

DEFAULT_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Candidate:
    """A chunk to write and the ranks that could write it."""

    item: WriteItem
    ranks: tuple[int, ...]


def split_box(box: Box, itemsize: int, chunk_bytes: int) -> list[Box]:
    """Split along dim 0 into pieces of about ``chunk_bytes``; each piece is contiguous on disk."""
    if not box.sizes or box.sizes[0] <= 1 or box.numel * itemsize <= chunk_bytes:
        return [box]
    row_bytes = max(1, (box.numel // box.sizes[0]) * itemsize)
    rows = max(1, chunk_bytes // row_bytes)
    pieces = []
    for start in range(0, box.sizes[0], rows):
        n = min(rows, box.sizes[0] - start)
        pieces.append(Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.sizes[1:])))
    return pieces


def candidates(all_metas: list[list[ItemMeta]], chunk_bytes: int) -> list[Candidate]:
    """Every unique chunk of the job, with the ranks that hold it (pure, order-independent)."""
    # Keyed by plain tuples, not Box: their hash runs in C, which matters at 10^6 items (4096 ranks).
    holders: dict[
        tuple[str, tuple[int, ...], tuple[int, ...]], tuple[ItemMeta, Box, list[int]]
    ] = {}
    out: list[Candidate] = []
    for rank, metas in enumerate(all_metas):
        for meta in metas:
            if meta.placement is Placement.RANK_LOCAL:
                out.extend(
                    Candidate(_write_item(meta, b, rank), (rank,))
                    for b in _split_all(meta, chunk_bytes)
                )
                continue
            for box in meta.boxes:
                entry = holders.get((meta.key, box.offsets, box.sizes))
                if entry is not None:
                    entry[2].append(rank)
                elif box.numel or not math.prod(
                    meta.shape
                ):  # an empty shard (more ranks than rows): nothing to write
                    holders[(meta.key, box.offsets, box.sizes)] = (meta, box, [rank])
    for meta, box, ranks in holders.values():
        writers = (0,) if meta.from_rank0 and 0 in ranks else tuple(sorted(ranks))
        for piece in split_box(box, meta.itemsize, chunk_bytes):
            out.append(Candidate(_write_item(meta, piece, -1), writers))
    return out


def assign(cands: list[Candidate], world_size: int) -> list[list[WriteItem]]:
    """Greedy largest-first onto the least-loaded holder: max share <= total/N + one chunk."""
    loads = [0] * world_size
    per_rank: list[list[WriteItem]] = [[] for _ in range(world_size)]
    fixed = [c for c in cands if len(c.ranks) == 1]
    flexible = sorted(
        (c for c in cands if len(c.ranks) > 1),
        key=lambda c: (-c.item.nbytes, c.item.key, c.item.box.offsets),
    )
    for c in fixed:
        _give(c, c.ranks[0], loads, per_rank)
    if world_size > 1 and all(len(c.ranks) == world_size for c in flexible):
        _assign_everywhere(flexible, loads, per_rank)
        return per_rank
    for c in flexible:
        _give(c, min(c.ranks, key=lambda r: (loads[r], r)), loads, per_rank)
    return per_rank


def _assign_everywhere(
    flexible: list[Candidate], loads: list[int], per_rank: list[list[WriteItem]]
) -> None:
    # All chunks can go anywhere (plain DDP): a heap makes this O(n log N) at 4096 ranks.
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for c in flexible:
        load, rank = heapq.heappop(heap)
        _give(c, rank, loads, per_rank)
        heapq.heappush(heap, (loads[rank], rank))


def _give(c: Candidate, rank: int, loads: list[int], per_rank: list[list[WriteItem]]) -> None:
    item = (
        c.item
        if c.item.rank == rank
        else WriteItem(
            c.item.key,
            c.item.dtype,
            c.item.shape,
            c.item.itemsize,
            c.item.placement,
            c.item.box,
            rank,
        )
    )
    per_rank[rank].append(item)
    loads[rank] += item.nbytes


def _split_all(meta: ItemMeta, chunk_bytes: int) -> list[Box]:
    return [piece for box in meta.boxes for piece in split_box(box, meta.itemsize, chunk_bytes)]


def _write_item(meta: ItemMeta, box: Box, rank: int) -> WriteItem:
    return WriteItem(meta.key, meta.dtype, meta.shape, meta.itemsize, meta.placement, box, rank)
