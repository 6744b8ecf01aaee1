"""Incremental saves on the writer thread: each chunk is hashed (its xxh3-64 blocks and its
xxh3-128 content digest in one pass over the staged bytes) before it is written; a chunk equal
to the same chunk of the previous step is referenced, the others are packed into the file.

The file's header names only the chunks written, so it is written last, at byte 0, padded with
spaces to the planned header's length (fewer entries never make it longer): the data then
starts where the plan said and needs no move. Dropping whole chunks of a file ordered by
itemsize keeps every later chunk aligned to its element size. A chunk that arrives in several
pieces is written as it comes once a block checksum differs from the earlier copy's (a
proven change); while all match, its pieces are held (copied) until the last one decides it
by the digest, at most one chunk per file.
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
class _Chunk:
    """A chunk being decided: its hashes so far, the earlier copy it may equal (None once
    it is known changed, or for a new chunk), and its pieces held while undecided."""

    hasher: BlockHasher
    prior: StoredChunk | None
    held: list[bytes] = field(default_factory=list)
    start: int | None = None  # where its bytes go once it is known changed: out as they come
    checked: int = 0  # blocks already compared with the earlier copy's checksums


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
    _chunks: dict[ChunkKey, _Chunk] = field(default_factory=dict)
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
        decided: a changed chunk's bytes as soon as it is known changed (a block checksum
        that differs from the earlier copy's proves it), an unchanged one's never."""
        key = (placed.file, placed.start, placed.end)
        c = self._chunks.get(key)
        if c is None:
            c = self._chunks[key] = _Chunk(BlockHasher(self.block_bytes, True), self._like(placed))
        c.hasher.update(data)
        if c.prior is not None and c.start is None and self._differs(c):
            c.prior = None
        if c.prior is None:  # changed or new: written now, with what was held
            pieces = [memoryview(b) for b in c.held] + [data]
            c.held = []
            at = self._emit(c, pieces)
        elif not last:
            c.held.append(bytes(data))  # undecided: the staged buffer is reused after this
            return self.cursor, []
        else:
            at, pieces = self.cursor, []
        if not last:
            return at, pieces
        del self._chunks[key]
        self._done += 1
        xxh3, digest = tuple(c.hasher.finish()), c.hasher.content_digest()
        if c.prior is not None:  # equal block checksums: the digest decides
            if c.prior.content == content_of(placed, digest):
                self.reused[key] = (c.prior, digest)
                return self.cursor, []
            at, pieces = self.cursor, [*(memoryview(b) for b in c.held), data]
            self._emit(c, pieces)
        assert c.start is not None  # for mypy: set by _emit
        self.written[key] = Written(c.start, c.start + placed.item.nbytes, xxh3, digest)
        self._order.append(placed)
        return at, pieces

    def _like(self, placed: PlacedItem) -> StoredChunk | None:
        """The earlier copy of this chunk if it may be equal (all but the digest agree)."""
        prior = self.reuse.chunks.get(chunk_id(placed.item.name, placed.item.box.offsets))
        if prior is None or placed.item.nbytes == 0:
            return None
        same = content_of(placed, prior.content.digest) == prior.content
        return prior if same else None

    def _differs(self, c: _Chunk) -> bool:
        """Whether a block hashed so far differs from the earlier copy's (same block size)."""
        assert c.prior is not None
        if c.prior.block_bytes != self.block_bytes:
            return False
        done = c.hasher.digests
        if len(done) > len(c.prior.xxh3):
            return True
        differs = any(done[i] != c.prior.xxh3[i] for i in range(c.checked, len(done)))
        c.checked = len(done)
        return differs

    def _emit(self, c: _Chunk, pieces: list[memoryview]) -> int:
        """Place ``pieces`` next in the file (the chunk starts at the first); returns where."""
        at = self.cursor
        if c.start is None:
            c.start = at
        self.cursor += sum(len(p) for p in pieces)
        return at

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
