"""Plans are data: boxes, item metadata and write items, as small frozen dataclasses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class Placement(str, Enum):
    REPLICATE = "replicate"  # every rank holds the whole tensor: written once in total
    SHARD = "shard"  # each rank holds boxes of it (DTensor): each unique box written once
    RANK_LOCAL = "rank_local"  # per-rank values under the same key: each rank writes its own


@dataclass(frozen=True)
class Box:
    """An N-D block of a tensor in global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def label(self) -> str:
        return ",".join(map(str, self.offsets))


@dataclass(frozen=True)
class ItemMeta:
    """What one rank holds under one key; exchanged once between ranks before planning."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    placement: Placement
    boxes: tuple[Box, ...]  # the parts this rank holds, in global coordinates
    from_rank0: bool = False  # replicas may differ (module buffers): rank 0's copy is written

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b in self.boxes) * self.itemsize


@dataclass(frozen=True)
class WriteItem:
    """One chunk that one rank writes: the bytes of ``box`` of tensor ``key``, row-major."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    placement: Placement
    box: Box
    rank: int

    @cached_property
    def nbytes(self) -> int:
        # cached: a save reads it several times per chunk, and math.prod is not free
        return self.box.numel * self.itemsize

    @cached_property
    def name(self) -> str:
        """The tensor's name inside its shard file (unique per file)."""
        prefix = f"rank{self.rank}/" if self.placement is Placement.RANK_LOCAL else ""
        return f"{prefix}{self.key}@{self.box.label()}"


@dataclass(frozen=True)
class PlacedItem:
    """A write item with its place in a shard file."""

    item: WriteItem
    file: str
    start: int  # absolute byte offset in the file

    @cached_property
    def end(self) -> int:
        return self.start + self.item.nbytes


@dataclass(frozen=True)
class FilePlan:
    path: str  # relative to the checkpoint directory
    header: bytes
    items: tuple[PlacedItem, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(p.item.nbytes for p in self.items)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    files: tuple[FilePlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)
