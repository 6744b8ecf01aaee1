"""Who writes what: replicated data once in total, balanced by bytes across ranks."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

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


class Assignment:
    """Each rank's chunks (what it writes) and, for the chunks several ranks could have
    written, who got each: the replica check's witnesses are found from it.

    The chunks of a box only one rank holds are counted in the loads at once, but made only
    for the rank that asks (``chunks_of``): a rank of a job of 4,096 needs its own, not the
    half million of all ranks.
    """

    def __init__(
        self,
        holdings: Holdings,
        chunk_bytes: int,
        fixed_writer: np.ndarray,
        local: dict[int, list[Chunk]],
        flexible: tuple[tuple[Flexible, int], ...],
        loads: list[int],
    ) -> None:
        self._holdings = holdings
        self._chunk_bytes = chunk_bytes
        self._fixed_writer = fixed_writer  # per holding: its one writer, or -1
        self._local = local
        self.flexible = flexible  # (chunk, its writer), largest first
        self.loads = tuple(loads)  # bytes each rank writes
        self._asked = False
        self._by_writer: tuple[np.ndarray, np.ndarray] | None = None
        self._given: dict[int, list[Chunk]] = {}
        for f, rank in flexible:
            self._given.setdefault(rank, []).append(f.chunk)

    @property
    def world_size(self) -> int:
        return len(self.loads)

    def chunks_of(self, rank: int) -> tuple[Chunk, ...]:
        """Its rank-local chunks, those of boxes it alone writes (in first-seen order), then
        those it was given, largest first."""
        a, mine = self._holdings.arrays, np.array(self._fixed_of(rank), dtype=np.int64)
        fixed: list[Chunk] = []
        columns = (a.key_ids, a.from_rank0, a.ndim, a.offsets, a.sizes)
        for key, flag, n, offsets, sizes in zip(*(c[mine].tolist() for c in columns)):
            box = Box(tuple(offsets[:n]), tuple(sizes[:n]))
            fixed += _pieces(self._holdings.meta(key, flag), box, self._chunk_bytes)
        return (*self._local.get(rank, ()), *fixed, *self._given.get(rank, ()))

    def _fixed_of(self, rank: int) -> list[int]:
        """The holdings ``rank`` alone writes, in first-seen order. The first rank asking
        scans the writers; a second one (tools laying out every rank) sorts them once."""
        if self._by_writer is None:
            if not self._asked:
                self._asked = True
                return np.flatnonzero(self._fixed_writer == rank).tolist()
            order = np.argsort(self._fixed_writer, kind="stable")
            bounds = np.searchsorted(self._fixed_writer[order], np.arange(self.world_size + 1))
            self._by_writer = (order, bounds)
        order, bounds = self._by_writer
        return order[bounds[rank] : bounds[rank + 1]].tolist()

    @property
    def chunks(self) -> tuple[tuple[Chunk, ...], ...]:
        """Every rank's chunks (tools and tests; a save asks only for its own)."""
        return tuple(self.chunks_of(r) for r in range(self.world_size))

    def __eq__(self, other: object) -> bool:  # the same writers of the same chunks
        if not isinstance(other, Assignment):
            return NotImplemented
        return self.flexible == other.flexible and self.chunks == other.chunks

    __hash__ = None  # type: ignore[assignment]


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
    a = holdings.arrays
    local: dict[int, list[Chunk]] = {}
    loads = np.zeros(world, dtype=np.int64)
    for rank, meta in holdings.local:
        for box in meta.boxes:
            for chunk in _pieces(meta, box, chunk_bytes):
                local.setdefault(rank, []).append(chunk)
                loads[rank] += chunk[2]
    # one writer: the only holder, or rank 0 for a from_rank0 key it holds
    writer = np.where(a.counts == 1, a.first_rank, -1)
    several = [h for h in holdings.several if not a.empty_shard[h.order]]
    for h in several:
        if h.meta.from_rank0 and 0 in h.ranks:
            writer[h.order] = 0
    writer[a.empty_shard] = -1  # an empty shard (more ranks than rows): nothing to write
    fixed = writer >= 0
    np.add.at(loads, writer[fixed], a.nbytes[fixed])
    flexible = [
        Flexible(chunk, tuple(sorted(h.ranks)))
        for h in several
        if writer[h.order] < 0
        for chunk in _pieces(h.meta, h.box, chunk_bytes)
    ]
    flexible.sort(key=lambda f: (-f.chunk[2], f.chunk[0].key, f.chunk[1].offsets))
    rank_loads = loads.tolist()
    given = _assign_flexible(flexible, rank_loads)
    return Assignment(holdings, chunk_bytes, writer, local, given, rank_loads)


def _pieces(meta: ItemMeta, box: Box, chunk_bytes: int) -> list[Chunk]:
    numel = box.numel
    pieces = split_box(box, meta.itemsize, chunk_bytes, numel)
    if len(pieces) == 1:
        return [(meta, box, numel * meta.itemsize)]
    return [(meta, p, p.numel * meta.itemsize) for p in pieces]


def _assign_flexible(
    flexible: list[Flexible], loads: list[int]
) -> tuple[tuple[Flexible, int], ...]:
    world = len(loads)
    if world > 1 and all(len(f.ranks) == world for f in flexible):
        # All chunks can go anywhere (plain DDP): a heap makes this O(n log N) at 4096 ranks.
        heap = [(load, rank) for rank, load in enumerate(loads)]
        heapq.heapify(heap)
        given = []
        for f in flexible:
            _, rank = heapq.heappop(heap)
            loads[rank] += f.chunk[2]
            heapq.heappush(heap, (loads[rank], rank))
            given.append((f, rank))
        return tuple(given)
    out = []
    for f in flexible:
        # the least-loaded holder, the lowest rank on a tie: ``ranks`` are sorted
        rank = min(f.ranks, key=loads.__getitem__)
        loads[rank] += f.chunk[2]
        out.append((f, rank))
    return tuple(out)
