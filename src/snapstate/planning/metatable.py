"""One rank's item metadata in columns: the metadata exchange's wire form (pure).

At 4,096 ranks the gather brings about a million (key, box) entries. As ItemMeta objects
they took 2 s to unpickle and another second to index; as a few numpy arrays and a list of
keys per rank they unpickle in a tenth of that and are indexed by array operations
(``planning/holdings.py``). ``pack`` and ``unpack`` convert losslessly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from snapstate.planning.items import Box, ItemMeta, Placement

PLACEMENTS = tuple(Placement)  # a placement's column value is its index here
# columns of ``MetaTable.metas``; the shape follows, padded with 1 to the table's width
ITEMSIZE, PLACEMENT, FROM_RANK0, NDIM, SHAPE = range(5)


@dataclass(frozen=True)
class Names:
    """A list of strings as one string and their lengths: unpickled as two objects, not one
    per name, and the equal lists of many ranks (the keys of a pipeline stage) told equal by
    one comparison, so each distinct list is split and indexed once."""

    text: str
    lengths: bytes  # int32 per name

    @staticmethod
    def of(names: Sequence[str]) -> Names:
        return Names("".join(names), np.array([len(n) for n in names], dtype=np.int32).tobytes())

    def split(self) -> list[str]:
        ends = np.cumsum(np.frombuffer(self.lengths, dtype=np.int32), dtype=np.int64).tolist()
        return [self.text[a:b] for a, b in zip([0, *ends], ends)]

    def __len__(self) -> int:
        return len(self.lengths) // 4


@dataclass(frozen=True)
class MetaTable:
    """A rank's metadata: ``keys[i]`` and ``dtypes[i]`` with row ``i`` of ``metas``
    (itemsize, placement index, from_rank0, ndim, shape...) and, per box, a row of ``boxes``
    (meta index, offsets..., sizes...). Dimensions beyond a tensor's ndim are padded with
    offset 0 and size 1, so a padded box's product is still its element count."""

    keys: Names
    dtypes: Names
    metas: np.ndarray  # (len(keys), SHAPE + width), int32 where the values fit, else int64
    boxes: np.ndarray  # (boxes, 1 + 2 * width), the same
    width: int  # the largest ndim

    def __len__(self) -> int:
        return len(self.metas)


def pack(metas: Sequence[ItemMeta]) -> MetaTable:
    width = max((len(m.shape) for m in metas), default=0)
    rows = np.ones((len(metas), SHAPE + width), dtype=np.int64)
    box_rows: list[list[int]] = []
    pad = [0] * width
    ones = [1] * width
    for i, m in enumerate(metas):
        n = len(m.shape)
        rows[i, :SHAPE] = (m.itemsize, PLACEMENTS.index(m.placement), m.from_rank0, n)
        rows[i, SHAPE : SHAPE + n] = m.shape
        for b in m.boxes:
            box_rows.append([i, *b.offsets, *pad[n:], *b.sizes, *ones[n:]])
    boxes = np.array(box_rows, dtype=np.int64).reshape(len(box_rows), 1 + 2 * width)
    return MetaTable(
        Names.of([m.key for m in metas]),
        Names.of([m.dtype for m in metas]),
        _narrowed(rows),
        _narrowed(boxes),
        width,
    )


def _narrowed(values: np.ndarray) -> np.ndarray:
    """int32 where every value fits (most shapes and offsets do): half the bytes to gather."""
    small = not values.size or (values.min() >= -(1 << 31) and values.max() < 1 << 31)
    return values.astype(np.int32) if small else values


def unpack(table: MetaTable) -> list[ItemMeta]:
    boxes: list[list[Box]] = [[] for _ in range(len(table))]
    w = table.width
    for row in table.boxes.tolist():
        n = table.metas[row[0], NDIM]
        boxes[row[0]].append(Box(tuple(row[1 : 1 + n]), tuple(row[1 + w : 1 + w + n])))
    keys, dtypes = table.keys.split(), table.dtypes.split()
    return [
        item_meta(keys[i], dtypes[i], table.metas[i].tolist(), tuple(boxes[i]))
        for i in range(len(table))
    ]


def item_meta(key: str, dtype: str, row: list[int], boxes: tuple[Box, ...]) -> ItemMeta:
    """The ItemMeta of one row of ``MetaTable.metas``."""
    n = row[NDIM]
    return ItemMeta(
        key,
        dtype,
        tuple(row[SHAPE : SHAPE + n]),
        row[ITEMSIZE],
        PLACEMENTS[row[PLACEMENT]],
        boxes,
        bool(row[FROM_RANK0]),
    )


def widened(table: MetaTable, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The table's two arrays padded to ``width`` dimensions (to stack tables of several ranks)."""
    extra = width - table.width
    if not extra:
        return table.metas, table.boxes  # stacked, then widened to int64 by the caller
    w = table.width
    metas = np.hstack([table.metas, np.ones((len(table.metas), extra), dtype=np.int64)])
    b = table.boxes
    zeros = np.zeros((len(b), extra), dtype=np.int64)
    ones = np.ones((len(b), extra), dtype=np.int64)
    return metas, np.hstack([b[:, : 1 + w], zeros, b[:, 1 + w :], ones])
