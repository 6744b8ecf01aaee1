"""The per-rank marker ``.markers/r<rank>.json``: what one rank wrote, read back by the committer.

A second on-disk format, though never visible to readers: it lives only between a rank's
fsync and the commit. It is parsed and validated like the manifest, so a torn, stale or
foreign marker fails the commit with a CorruptCheckpointError naming the file and key
instead of a KeyError (see ``format/SPEC.md``, "Markers").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from snapstate.format.validation import FieldChecks

MARKER_FORMAT = "snapstate-marker"
MARKER_VERSION = 1
PLACEMENTS = ("replicate", "shard", "rank_local")


@dataclass(frozen=True)
class MarkerChunk:
    """One chunk a rank wrote: where it lies in the global tensor and in its file."""

    key: str
    placement: str  # "replicate" | "shard" | "rank_local"
    file: str
    name: str
    start: int
    end: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    block_bytes: int
    xxh3: tuple[str, ...]  # of the stored bytes
    # compressed chunks only: the codec, each frame's (stored, raw) bytes, and the checksums
    # of the raw bytes, which the replica witnesses (who hash raw bytes) are compared with
    codec: str | None = None
    frames: tuple[tuple[int, int], ...] = ()
    raw_xxh3: tuple[str, ...] = ()
    digest: str | None = None  # incremental saves: xxh3-128 of the chunk's bytes


@dataclass(frozen=True)
class LocalTensor:
    """A rank-local tensor's description (its chunks are in ``Marker.chunks``)."""

    dtype: str
    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class Marker:
    """What one rank reports after its shards are fsynced."""

    rank: int
    files: dict[str, int]  # path -> size in bytes
    chunks: tuple[MarkerChunk, ...]
    kinds: dict[str, str]  # key -> "tensor" | "ndarray" | "npscalar"
    local_trees: dict[str, Any] = field(default_factory=dict)
    local_tensors: dict[str, LocalTensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    tree: dict[str, Any] | None = None  # only when this rank's structure differs from rank 0's
    # chunk name -> xxh3 blocks of this rank's copy of a chunk another rank wrote
    replicas: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "rank": self.rank,
            "files": self.files,
            "chunks": [_chunk_json(c) for c in self.chunks],
            "kinds": self.kinds,
            "rank_local": {
                "trees": self.local_trees,
                "tensors": {
                    k: {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
                    for k, t in self.local_tensors.items()
                },
            },
            "timings": self.timings,
        }
        if self.tree is not None:
            doc["tree"] = self.tree
        if self.replicas:
            doc["replicas"] = {name: list(h) for name, h in self.replicas.items()}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _chunk_json(c: MarkerChunk) -> dict[str, Any]:
    doc = {
        "key": c.key,
        "placement": c.placement,
        "file": c.file,
        "name": c.name,
        "start": c.start,
        "end": c.end,
        "offsets": list(c.offsets),
        "sizes": list(c.sizes),
        "block_bytes": c.block_bytes,
        "xxh3": list(c.xxh3),
    }
    if c.codec is not None:
        doc.update(codec=c.codec, frames=[list(f) for f in c.frames], raw_xxh3=list(c.raw_xxh3))
    if c.digest is not None:
        doc["digest"] = c.digest
    return doc


def parse_marker(raw: bytes, file: str, rank: int | None = None) -> Marker:
    """Parse and validate one marker; ``rank`` is the rank it must belong to."""
    check = _Check(file)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise check.fail(f"marker is not valid JSON: {exc}") from None
    check.require(isinstance(doc, dict), "marker is not a JSON object")
    check.require(
        doc.get("format") == MARKER_FORMAT and doc.get("version") == MARKER_VERSION,
        f"not a {MARKER_FORMAT} v{MARKER_VERSION} marker",
        "format",
    )
    found = check.integer(doc.get("rank"), "rank")
    check.require(rank is None or found == rank, f"marker of rank {found}, expected {rank}", "rank")
    local = check.mapping(doc.get("rank_local"), "rank_local")
    tree = doc.get("tree")
    check.require(tree is None or isinstance(tree, dict), "tree is not an object", "tree")
    return Marker(
        rank=found,
        files={check.text(p, "files"): check.integer(s, p) for p, s in _items(check, doc, "files")},
        chunks=tuple(check.marker_chunk(c) for c in check.array(doc.get("chunks"), "chunks")),
        kinds={k: check.text(v, k) for k, v in _items(check, doc, "kinds")},
        local_trees=check.mapping(local.get("trees"), "rank_local.trees"),
        local_tensors={
            k: check.local_tensor(k, t)
            for k, t in check.mapping(local.get("tensors"), "rank_local.tensors").items()
        },
        timings=check.mapping(doc.get("timings", {}), "timings"),
        tree=tree,
        replicas={
            name: tuple(check.text(h, name) for h in check.array(hs, name))
            for name, hs in _items(check, doc, "replicas", optional=True)
        },
    )


def _items(check: _Check, doc: dict[str, Any], key: str, optional: bool = False) -> Any:
    value = doc.get(key, {} if optional else None)
    return check.mapping(value, key).items()


class _Check(FieldChecks):
    """The shared field checks (fail, require, mapping, integer) plus the marker's records."""

    def array(self, value: Any, key: str) -> list[Any]:
        self.require(isinstance(value, list), f"{key} is not a list", key)
        return value

    def text(self, value: Any, key: str) -> str:
        self.require(isinstance(value, str), f"{value!r} is not a string"[:200], key)
        return value

    def int_tuple(self, value: Any, key: str) -> tuple[int, ...]:
        return tuple(self.integer(x, key) for x in self.array(value, key))

    def marker_chunk(self, value: Any) -> MarkerChunk:
        c = self.mapping(value, "chunks")
        key = self.text(c.get("key"), "chunks")
        chunk = MarkerChunk(
            key=key,
            placement=self.text(c.get("placement"), key),
            file=self.text(c.get("file"), key),
            name=self.text(c.get("name"), key),
            start=self.integer(c.get("start"), key),
            end=self.integer(c.get("end"), key),
            offsets=self.int_tuple(c.get("offsets"), key),
            sizes=self.int_tuple(c.get("sizes"), key),
            block_bytes=self.integer(c.get("block_bytes"), key),
            xxh3=tuple(self.text(h, key) for h in self.array(c.get("xxh3"), key)),
            **self.compression(c, key),
            digest=None if c.get("digest") is None else self.text(c["digest"], key),
        )
        self.require(chunk.placement in PLACEMENTS, f"unknown placement {chunk.placement!r}", key)
        self.require(chunk.start <= chunk.end, "chunk ends before it starts", key)
        self.require(len(chunk.offsets) == len(chunk.sizes), "offsets and sizes differ", key)
        self.require(chunk.block_bytes > 0, "block_bytes is not positive", key)
        return chunk

    def compression(self, c: dict[str, Any], key: str) -> dict[str, Any]:
        """A compressed chunk's codec fields (none for a stored one)."""
        if c.get("codec") is None:
            return {}
        frames = [self.int_tuple(f, key) for f in self.array(c.get("frames"), key)]
        self.require(all(len(f) == 2 for f in frames), "a frame is not [stored, raw]", key)
        return {
            "codec": self.text(c["codec"], key),
            "frames": tuple((f[0], f[1]) for f in frames),
            "raw_xxh3": tuple(self.text(h, key) for h in self.array(c.get("raw_xxh3"), key)),
        }

    def local_tensor(self, key: str, value: Any) -> LocalTensor:
        t = self.mapping(value, key)
        return LocalTensor(
            self.text(t.get("dtype"), key),
            self.int_tuple(t.get("shape"), key),
            self.text(t.get("kind"), key),
        )
