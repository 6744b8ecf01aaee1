"""Who holds what: every rank's gathered metadata indexed by (key, box) at once (pure).

At 4,096 ranks the gathered metadata has about a million entries. Every question the planner
asks of it (do the ranks agree on shared keys, which ranks hold each box, which boxes are
replicated) is answered from this one index. It is built by array operations over the
ranks' metadata tables (``planning/metatable.py``): Python objects are made only for the
keys, for the boxes several ranks hold, and later for the chunks of the rank that asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.metatable import (
    FROM_RANK0,
    ITEMSIZE,
    NDIM,
    PLACEMENT,
    PLACEMENTS,
    SHAPE,
    MetaTable,
    Names,
    item_meta,
    pack,
    widened,
)

RANK_LOCAL = PLACEMENTS.index(Placement.RANK_LOCAL)


class Holding:
    """One (key, box) of shared state that several ranks hold, in rank order."""

    __slots__ = ("meta", "box", "ranks", "order")

    def __init__(self, meta: ItemMeta, box: Box, ranks: list[int], order: int) -> None:
        self.meta = meta  # the key's metadata, with the first holder's from_rank0
        self.box = box
        self.ranks = ranks
        self.order = order  # its place among all holdings, in first-seen order


@dataclass(frozen=True)
class HoldingArrays:
    """Every shared (key, box), in first-seen order, as columns (row ``h`` = holding ``h``)."""

    key_ids: np.ndarray  # into ``Holdings.keys``
    offsets: np.ndarray  # (holdings, width), padded with 0
    sizes: np.ndarray  # (holdings, width), padded with 1
    ndim: np.ndarray
    itemsize: np.ndarray
    from_rank0: np.ndarray  # the first holder's
    counts: np.ndarray  # how many ranks hold it
    first_rank: np.ndarray  # the first of them
    nbytes: np.ndarray
    empty_shard: np.ndarray  # no element of a tensor that has some: nothing to write
    holders: np.ndarray  # the ranks of each holding several ranks hold, holding after holding
    starts: np.ndarray  # where each such holding's ranks start in ``holders``

    def ranks_of(self, h: int) -> list[int]:
        if self.counts[h] == 1:
            return [int(self.first_rank[h])]
        start = int(self.starts[h])
        return self.holders[start : start + int(self.counts[h])].tolist()

    def box(self, h: int) -> Box:
        n = int(self.ndim[h])
        return Box(tuple(self.offsets[h, :n].tolist()), tuple(self.sizes[h, :n].tolist()))


@dataclass(frozen=True)
class Holdings:
    """The gathered metadata indexed once: the same on every rank."""

    world_size: int
    arrays: HoldingArrays  # every replicated or sharded (key, box)
    several: list[Holding]  # those two ranks or more hold, in first-seen order
    local: list[tuple[int, ItemMeta]]  # rank-local items with their rank, in rank order
    metas: dict[str, ItemMeta]  # one metadata per shared key, in first-seen order
    keys: list[str]  # key id -> key
    problems: list[str]  # shared keys the ranks disagree on (dtype, shape or placement)

    def meta(self, key_id: int, from_rank0: bool) -> ItemMeta:
        """The key's metadata, with a holder's ``from_rank0``."""
        return _meta_of(self.metas, self.keys, key_id, from_rank0)


class _Gathered:
    """Every rank's tables stacked: one row per meta and one per box, ranks in order."""

    def __init__(self, tables: list[MetaTable]) -> None:
        width = max((t.width for t in tables), default=0)
        parts = [widened(t, width) for t in tables]
        self.width = width
        self.metas = _stack([p[0] for p in parts], SHAPE + width).astype(np.int64, copy=False)
        self.boxes = _stack([p[1] for p in parts], 1 + 2 * width).astype(np.int64, copy=False)
        counts = [len(t) for t in tables]
        self.meta_rank = np.repeat(np.arange(len(tables), dtype=np.int64), counts)
        base = np.cumsum(counts, dtype=np.int64) - np.array(counts, dtype=np.int64)
        self.box_meta = self.boxes[:, 0] + np.repeat(base, [len(t.boxes) for t in tables])
        self.key_names, self.key_ids = _ids([t.keys for t in tables])
        self.dtype_names, self.dtype_ids = _ids([t.dtypes for t in tables])

    def meta_at(self, row: int, with_boxes: bool = True) -> ItemMeta:
        boxes: tuple[Box, ...] = ()
        n = int(self.metas[row, NDIM])
        if with_boxes:  # a meta's box rows are consecutive: tables list them in meta order
            lo, hi = np.searchsorted(self.box_meta, [row, row + 1])
            w = self.width
            boxes = tuple(
                Box(tuple(b[1 : 1 + n]), tuple(b[1 + w : 1 + w + n]))
                for b in self.boxes[lo:hi].tolist()
            )
        return item_meta(
            self.key_names[self.key_ids[row]],
            self.dtype_names[self.dtype_ids[row]],
            self.metas[row].tolist(),
            boxes,
        )


def gather_holdings(all_metas: Sequence[Sequence[ItemMeta] | MetaTable]) -> Holdings:
    """Index ``all_metas`` (one list or table per rank) by (key, box)."""
    g = _Gathered([t if isinstance(t, MetaTable) else pack(t) for t in all_metas])
    shared = g.metas[:, PLACEMENT] != RANK_LOCAL
    local = [(int(g.meta_rank[r]), g.meta_at(r)) for r in np.flatnonzero(~shared).tolist()]
    first_row, problems = _first_metas(g, np.flatnonzero(shared))
    metas = {m.key: m for m in (g.meta_at(r) for r in sorted(first_row.values()))}
    arrays = _index_boxes(g, shared[g.box_meta])
    several = [
        Holding(
            _meta_of(metas, g.key_names, int(arrays.key_ids[h]), bool(arrays.from_rank0[h])),
            arrays.box(h),
            arrays.ranks_of(h),
            h,
        )
        for h in np.flatnonzero(arrays.counts > 1).tolist()
    ]
    return Holdings(len(all_metas), arrays, several, local, metas, g.key_names, problems)


def _meta_of(metas: dict[str, ItemMeta], keys: list[str], key_id: int, flag: bool) -> ItemMeta:
    meta = metas[keys[key_id]]
    return meta if meta.from_rank0 == flag else replace(meta, from_rank0=flag)


def _first_metas(g: _Gathered, rows: np.ndarray) -> tuple[dict[int, int], list[str]]:
    """Each shared key's first row, and the rows that disagree with it, described."""
    key_ids = g.key_ids[rows]
    uniq, first = np.unique(key_ids, return_index=True)
    first_of = np.zeros(len(g.key_names), dtype=np.int64)
    first_of[uniq] = rows[first]
    # what ranks must agree on: dtype, placement, ndim, shape (not itemsize, nor from_rank0);
    # a column at a time, without copying the table
    lead = first_of[key_ids]
    differ = g.dtype_ids[rows] != g.dtype_ids[lead]
    for column in (PLACEMENT, *range(NDIM, g.metas.shape[1])):
        values = g.metas[:, column]
        differ |= values[rows] != values[lead]
    problems = [
        _describe(
            int(g.meta_rank[first_of[g.key_ids[r]]]),
            g.meta_at(int(first_of[g.key_ids[r]]), False),
            int(g.meta_rank[r]),
            g.meta_at(r, False),
        )
        for r in rows[differ].tolist()
    ]
    return {int(k): int(r) for k, r in zip(uniq.tolist(), rows[first].tolist())}, problems


def _index_boxes(g: _Gathered, mask: np.ndarray) -> HoldingArrays:
    """The distinct (key, box) of the masked box rows, in first-seen order, and their ranks."""
    rows = np.flatnonzero(mask)
    metas = g.box_meta[rows]
    keyed = np.ascontiguousarray(np.hstack([g.key_ids[metas][:, None], g.boxes[rows, 1:]]))
    as_bytes = keyed.view(np.dtype((np.void, keyed.itemsize * keyed.shape[1]))).ravel()
    _, first, inverse = np.unique(as_bytes, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # np.unique sorts by value: back to first seen
    position = np.empty(len(first), dtype=np.int64)
    position[order] = np.arange(len(first), dtype=np.int64)
    holding = position[inverse.ravel()]
    counts = np.bincount(holding, minlength=len(first)).astype(np.int64)
    lead = rows[first[order]]  # each holding's first box row
    # the ranks of boxes several ranks hold, grouped by holding in rank order (the rest's
    # only rank is that of its first row)
    several = np.flatnonzero(counts[holding] > 1)
    grouped = several[np.argsort(holding[several], kind="stable")]
    holders = g.meta_rank[metas[grouped]]
    starts = np.cumsum(np.where(counts > 1, counts, 0)) - np.where(counts > 1, counts, 0)
    meta = g.box_meta[lead]
    w = g.width
    sizes = g.boxes[lead, 1 + w :]
    numel = np.prod(sizes, axis=1, dtype=np.int64)
    itemsize = g.metas[meta, ITEMSIZE]
    return HoldingArrays(
        key_ids=g.key_ids[meta],
        offsets=g.boxes[lead, 1 : 1 + w],
        sizes=sizes,
        ndim=g.metas[meta, NDIM],
        itemsize=itemsize,
        from_rank0=g.metas[meta, FROM_RANK0].astype(bool),
        counts=counts,
        first_rank=g.meta_rank[g.box_meta[lead]],
        nbytes=numel * itemsize,
        empty_shard=(numel == 0) & (np.prod(g.metas[meta, SHAPE:], axis=1, dtype=np.int64) > 0),
        holders=holders,
        starts=starts,
    )


def _ids(lists: list[Names]) -> tuple[list[str], np.ndarray]:
    """The distinct names of every rank's list in first-seen order, and each entry's index
    among them; a list equal to an earlier rank's is indexed once."""
    index: dict[str, int] = {}
    known: dict[tuple[str, bytes], np.ndarray] = {}
    parts = []
    for names in lists:
        ids = known.get((names.text, names.lengths))
        if ids is None:
            ids = np.array([index.setdefault(n, len(index)) for n in names.split()], dtype=np.int64)
            known[(names.text, names.lengths)] = ids
        parts.append(ids)
    return list(index), np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _stack(parts: list[np.ndarray], width: int) -> np.ndarray:
    return np.concatenate(parts, axis=0) if parts else np.zeros((0, width), dtype=np.int64)


def _describe(first_rank: int, first: ItemMeta, rank: int, meta: ItemMeta) -> str:
    return (
        f"{meta.key!r}: rank {first_rank} has {first.placement.value} {first.dtype}"
        f"{list(first.shape)}, rank {rank} has {meta.placement.value} {meta.dtype}"
        f"{list(meta.shape)}"
    )
