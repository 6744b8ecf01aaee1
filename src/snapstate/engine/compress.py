"""Compressed shard files: a persist thread encodes each piece, then writes the file in order.

A compressed chunk's size is known only once it is encoded, and the safetensors header that
comes first names every entry's offsets, so a compressed file is held as frames until its last
chunk is encoded (at most one file's compressed bytes per writer thread, ``PlanOptions``'
``max_file_bytes`` raw), then written header first, sequentially, as object stores need. The
block checksums are those of the stored bytes, so a load finds damage before decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from snapstate.format import codec
from snapstate.format.integrity import BlockHasher
from snapstate.format.shard import ShardEntry, build_header
from snapstate.planning.items import PlacedItem
from snapstate.planning.layout import FilePlan

# Chunks smaller than this are stored as they are: a frame's headers would eat the saving.
MIN_COMPRESS_BYTES = 4096
ChunkKey = tuple[str, int, int]  # (file, planned start, planned end), as PersistStats keys


@dataclass(frozen=True)
class StoredChunk:
    """Where a chunk lies in its compressed file; ``codec`` None: its raw bytes, unencoded."""

    start: int
    end: int
    codec: str | None
    frames: tuple[tuple[int, int], ...]
    xxh3: tuple[str, ...]


def chunk_key(placed: PlacedItem) -> ChunkKey:
    return (placed.file, placed.start, placed.end)


def group_width_of(placed: PlacedItem) -> int:
    """Byte planes for this chunk's dtype (1 for integers and bool)."""
    return codec.group_width(placed.item.dtype, placed.item.itemsize)


@dataclass
class CompressedFile:
    """One shard file's frames, collected in chunk order until its last chunk is complete."""

    plan: FilePlan
    block_bytes: int
    level: int = 1
    _frames: dict[ChunkKey, list[tuple[bytes | memoryview, int]]] = field(default_factory=dict)
    _done: int = 0

    def add(self, placed: PlacedItem, data: memoryview, last: bool) -> bool:
        """One piece of a chunk (pieces in order); True once the file's every chunk is in.

        Small chunks keep a copy of their raw bytes: the staged buffer is reused after this.
        """
        if placed.item.nbytes < MIN_COMPRESS_BYTES:
            frame: bytes | memoryview = bytes(data)
        else:
            frame = codec.encode(data, group_width_of(placed), self.level)
        self._frames.setdefault(chunk_key(placed), []).append((frame, len(data)))
        self._done += last
        return self._done == len(self.plan.items)

    def layout(self) -> tuple[tuple[memoryview, ...], dict[ChunkKey, StoredChunk]]:
        """The file's bytes in order (header, then every frame) and its chunks' places."""
        planned = json.loads(self.plan.header[8:])
        entries, stored = [], {}
        at = 0
        for p in self.plan.items:
            frames = self._frames.get(chunk_key(p), [])
            size = sum(len(f) for f, _ in frames)
            raw = p.item.nbytes < MIN_COMPRESS_BYTES
            entry = planned[p.item.name]
            dtype, shape = (entry["dtype"], entry["shape"]) if raw else ("U8", [size])
            entries.append(ShardEntry(p.item.name, dtype, shape, size))
            stored[chunk_key(p)] = (at, size, raw, frames)
            at += size
        header, starts = build_header(entries, planned.get("__metadata__", {}))
        base = starts[0] if starts else len(header)
        buffers = [memoryview(header)]
        places = {}
        for key, (offset, size, raw, frames) in stored.items():
            hasher = BlockHasher(self.block_bytes)
            for frame, _ in frames:
                hasher.update(memoryview(frame))
                buffers.append(memoryview(frame))
            places[key] = StoredChunk(
                base + offset,
                base + offset + size,
                None if raw else "zstd",
                () if raw else tuple((len(f), n) for f, n in frames),
                tuple(hasher.finish()),
            )
        return tuple(buffers), places
