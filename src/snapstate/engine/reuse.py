"""Incremental saves on the writer thread: each chunk is hashed (its xxh3-64 blocks and its
xxh3-128 content digest in one pass over the staged bytes) before it is written; a chunk equal
to the same chunk of the previous step is referenced, the others are packed into the file.

The file's header names only the chunks written, so it is written last, at byte 0, padded with
spaces to the planned header's length (fewer entries never make it longer): the data then
starts where the plan said and needs no move. Dropping whole chunks of a file ordered by
itemsize keeps every later chunk aligned to its element size. A chunk that arrives in several
pieces is held (copied) until its last piece decides it, at most one chunk per file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from snapstate.format.integrity import BlockHasher
from snapstate.format.manifest import DigestChunk, Manifest
from snapstate.format.marker import Marker
from snapstate.format.shard import ShardEntry, build_header
from snapstate.planning.incremental import (
    ChunkContent,
    ChunkId,
    Reuse,
    StoredChunk,
    chunk_id,
    reference,
    resolve,
)
from snapstate.planning.items import FilePlan, PlacedItem, RankPlan

if TYPE_CHECKING:
    from snapstate.engine.persist import PersistStats

ChunkKey = tuple[str, int, int]  # (file, planned start, planned end), as PersistStats keys


def content_of(placed: PlacedItem, digest: str) -> ChunkContent:
    item = placed.item
    return ChunkContent(tuple(item.box.sizes), item.dtype, "raw", item.nbytes, digest)


def prior_from_manifest(manifest: Manifest, prior_step: str, step: str) -> Reuse:
    """What a save of ``step`` may reference of ``prior_step`` (whose manifest is given): its
    chunks that carry a digest, with their files root-relative, so references never chain."""
    chunks: dict[ChunkId, StoredChunk] = {}
    for key, rec in manifest.all_tensors().items():
        for c in rec.chunks:
            if isinstance(c, DigestChunk) and not c.compressed:
                stored = c.end - c.start
                content = ChunkContent(tuple(c.sizes), rec.dtype, "raw", stored, c.digest)
                file = resolve(prior_step, c.file)
                chunks[(key, tuple(c.offsets))] = StoredChunk(
                    content, file, c.name, c.start, c.end, c.block_bytes, tuple(c.xxh3)
                )
    sizes = {resolve(prior_step, f): r.bytes for f, r in manifest.files.items()}
    return Reuse(step, chunks, sizes)


@dataclass(frozen=True)
class Written:
    """A chunk written by this save: where it landed, its blocks and its content digest."""

    start: int
    end: int
    xxh3: tuple[str, ...]
    digest: str


@dataclass
class ReusingFile:
    """One shard file of an incremental save, filled chunk by chunk in plan order."""

    plan: FilePlan
    block_bytes: int
    reuse: Reuse
    cursor: int = 0
    written: dict[ChunkKey, Written] = field(default_factory=dict)
    reused: dict[ChunkKey, tuple[StoredChunk, str]] = field(default_factory=dict)
    _order: list[PlacedItem] = field(default_factory=list)
    _hashers: dict[ChunkKey, BlockHasher] = field(default_factory=dict)
    _held: dict[ChunkKey, list[bytes]] = field(default_factory=dict)
    _done: int = 0

    def __post_init__(self) -> None:
        self.cursor = len(self.plan.header)

    @property
    def complete(self) -> bool:
        return self._done == len(self.plan.items)

    @property
    def empty(self) -> bool:
        """Every chunk referenced: the file is not needed at all."""
        return self.complete and not self.written

    def add(self, placed: PlacedItem, data: memoryview, last: bool) -> tuple[int, list[memoryview]]:
        """One piece of a chunk (pieces in order); returns where to write what this piece
        decided (nothing while a chunk is incomplete or when it is referenced)."""
        key = (placed.file, placed.start, placed.end)
        hasher = self._hashers.setdefault(key, BlockHasher(self.block_bytes, content=True))
        hasher.update(data)
        if not last:
            self._held.setdefault(key, []).append(bytes(data))  # the staged buffer is reused
            return self.cursor, []
        del self._hashers[key]
        self._done += 1
        xxh3, digest = tuple(hasher.finish()), hasher.content_digest()
        pieces = [memoryview(b) for b in self._held.pop(key, [])]
        pieces.append(data)
        cid = chunk_id(placed.item.name, placed.item.box.offsets)
        prior = self.reuse.reusable(cid, content_of(placed, digest))
        if prior is not None and placed.item.nbytes > 0:
            self.reused[key] = (prior, digest)
            return self.cursor, []
        at = self.cursor
        self.cursor += placed.item.nbytes
        self.written[key] = Written(at, self.cursor, xxh3, digest)
        self._order.append(placed)
        return at, pieces

    def header(self) -> bytes:
        """The header of the chunks written, as long as the planned one (space padded)."""
        planned = json.loads(self.plan.header[8:])
        entries = []
        for p in self._order:
            entry = planned[p.item.name]
            entries.append(ShardEntry(p.item.name, entry["dtype"], entry["shape"], p.item.nbytes))
        header, _ = build_header(entries, planned.get("__metadata__", {}))
        text = header[8:].rstrip(b" ")
        room = len(self.plan.header) - 8
        if len(text) > room:  # cannot happen: fewer entries at smaller offsets
            raise AssertionError("an incremental shard header outgrew the planned one")
        return struct.pack("<Q", room) + text + b" " * (room - len(text))


def with_references(marker: Marker, plan: RankPlan, stats: PersistStats, reuse: Reuse) -> Marker:
    """The rank's marker once its chunks are decided: each carries its digest, a referenced
    one names the earlier file (``../step-<n>/...``) and its place there, and the files are
    those written plus those referenced."""
    placed = [p for f in plan.files for p in f.items]
    chunks = []
    files = {path: size for path, size in marker.files.items() if path not in stats.dropped}
    for p, c in zip(placed, marker.chunks, strict=True):
        key = (p.file, p.start, p.end)
        prior = stats.reused.get(key)
        if prior is None:
            chunks.append(replace(c, digest=stats.content[key]))
            continue
        file = reference(reuse.step, prior.file)
        files[file] = reuse.file_bytes[prior.file]
        chunks.append(
            replace(
                c,
                file=file,
                start=prior.start,
                end=prior.end,
                block_bytes=prior.block_bytes,
                xxh3=prior.xxh3,
                digest=stats.content[key],
            )
        )
    return replace(marker, chunks=tuple(chunks), files=files)
