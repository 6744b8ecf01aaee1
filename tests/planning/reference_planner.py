"""The save planner as it was before the columnar index (one Python pass over every rank's
metadata), kept as the reference the planner's output is compared with. Not a test."""

from __future__ import annotations

import math

from snapstate.planning.dedup import split_box
from snapstate.planning.items import Box, ItemMeta, Placement, WriteItem

Chunk = tuple[ItemMeta, Box, int]


def reference_problems(all_metas: list[list[ItemMeta]]) -> list[str]:
    first: dict[str, tuple[int, ItemMeta]] = {}
    problems = []
    for rank, metas in enumerate(all_metas):
        for meta in metas:
            if meta.placement is Placement.RANK_LOCAL:
                continue
            seen = first.setdefault(meta.key, (rank, meta))
            a = seen[1]
            if (a.dtype, a.shape, a.placement) != (meta.dtype, meta.shape, meta.placement):
                problems.append(
                    f"{meta.key!r}: rank {seen[0]} has {a.placement.value} {a.dtype}"
                    f"{list(a.shape)}, rank {rank} has {meta.placement.value} {meta.dtype}"
                    f"{list(meta.shape)}"
                )
    return problems


def reference_plan(
    all_metas: list[list[ItemMeta]], chunk_bytes: int
) -> tuple[list[list[WriteItem]], list[tuple[WriteItem, tuple[int, ...]]]]:
    """Every rank's write items in order, and each flexible chunk with its candidates."""
    world = len(all_metas)
    holders: dict[tuple[str, Box], tuple[ItemMeta, list[int]]] = {}
    chunks: list[list[Chunk]] = [[] for _ in range(world)]
    loads = [0] * world

    def give(rank: int, chunk: Chunk) -> None:
        chunks[rank].append(chunk)
        loads[rank] += chunk[2]

    for rank, metas in enumerate(all_metas):
        for meta in metas:
            for box in meta.boxes:
                if meta.placement is Placement.RANK_LOCAL:
                    for piece in split_box(box, meta.itemsize, chunk_bytes):
                        give(rank, (meta, piece, piece.numel * meta.itemsize))
                else:
                    holders.setdefault((meta.key, box), (meta, []))[1].append(rank)
    flexible: list[tuple[Chunk, tuple[int, ...]]] = []
    for (_, box), (meta, ranks) in holders.items():
        if not box.numel and math.prod(meta.shape) > 0:
            continue
        writers = [0] if meta.from_rank0 and 0 in ranks else ranks
        for piece in split_box(box, meta.itemsize, chunk_bytes):
            chunk = (meta, piece, piece.numel * meta.itemsize)
            if len(writers) == 1:
                give(writers[0], chunk)
            else:
                flexible.append((chunk, tuple(sorted(writers))))
    flexible.sort(key=lambda f: (-f[0][2], f[0][0].key, f[0][1].offsets))
    given = []
    for chunk, ranks in flexible:
        rank = min(ranks, key=lambda r: (loads[r], r))
        give(rank, chunk)
        given.append((_item(chunk, rank), ranks))
    return [[_item(c, r) for c in cs] for r, cs in enumerate(chunks)], given


def _item(chunk: Chunk, rank: int) -> WriteItem:
    meta, box, _ = chunk
    return WriteItem(meta.key, meta.dtype, meta.shape, meta.itemsize, meta.placement, box, rank)
